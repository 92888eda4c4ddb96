"""Is a host name this machine? A `.local` name, an internal FQDN and any of this machine's
IPs all name the same host, so a worker is never enrolled twice under different names."""

import ipaddress
import socket

import psutil


def local_addresses() -> set[str]:
    addresses = {"127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addresses.add(entry.address.split("%", 1)[0])
    return addresses


def local_names() -> set[str]:
    short = socket.gethostname().split(".", 1)[0].lower()
    names = {"localhost", short, short + ".local", socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return names


def resolve(host: str) -> set[str]:
    """Every address `host` resolves to (empty when it does not resolve)."""
    try:
        return {info[4][0].split("%", 1)[0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return set()


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback IP: reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_local_host(host: str) -> bool:
    host = host.strip().strip("[]").lower().rstrip(".")
    if host in local_names() or is_loopback(host):
        return True
    try:
        return str(ipaddress.ip_address(host)) in local_addresses()
    except ValueError:
        pass
    addresses = resolve(host)
    mine = local_addresses()
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback or a in mine for a in addresses)


def same_host(a: str, b: str) -> bool:
    """Two names of one machine: equal, both local, or resolving to a shared address."""
    if a.lower() == b.lower():
        return True
    if is_local_host(a) and is_local_host(b):
        return True
    return bool(resolve(a) & resolve(b))


def primary_address() -> str:
    """The IP other machines reach this one on (the route to a public address; nothing is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
