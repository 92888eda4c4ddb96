"""A streaming, verifiable FP16 clone of an MLX checkpoint, for CPU sharing in prefill.

The CPU lane computes on fp16 weights, so it needs a checkpoint whose floating tensors
are fp16. The clone converts bf16/fp32/fp64 tensors to fp16 and copies everything else
byte-for-byte (packed quantized weights stay the same quantized checkpoint), one tensor
at a time through small memory-mapped windows, so memory stays near one chunk, not the
checkpoint. Shards are written to a temp directory beside DST (`.DST.omlx-tmp-<pid>`)
and renamed into place only after every tensor, file and the verification succeeded;
any error, Ctrl-C or SIGTERM removes it. A SIGKILLed clone leaves its temp directory,
which the next clone to the same DST removes once its pid is dead. SRC is only read.
"""

import json
import math
import mmap
import os
import shutil
import signal
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from omlx_core.errors import InputError, OmlxError
from omlx_core.processes import pid_alive
from omlx_core.models.checkpoint import check_checkpoint, read_config, tensor_index, weight_files
from omlx_core.models.fingerprint import model_fingerprint
from omlx_core.models.fp16 import Converter, RangeCounts, f64_to_fp16

INDEX_FILE = "model.safetensors.index.json"
_CONVERTED = {"BF16": np.uint16, "F32": np.uint32, "F64": np.float64}  # read as these
_ITEMSIZE = {"BF16": 2, "F32": 4, "F64": 8, "F16": 2}
_WINDOW = 32 << 20  # source bytes mapped at a time, then dropped from memory
_CHUNK = 1 << 18  # values converted at a time: the scratch buffers stay in cache
_TMP_TAG, _OLD_TAG = ".omlx-tmp-", ".omlx-old-"

Progress = Callable[[str, int, int], None]  # (stage "convert" | "verify", done, total)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived mid-clone; raised like Ctrl-C so the same cleanup runs."""


@dataclass
class CloneReport:
    source: str
    destination: str
    source_fingerprint: str
    fingerprint: str = ""
    shards: int = 0
    tensors_converted: int = 0  # bf16/fp32/fp64 written as fp16
    tensors_copied: int = 0  # fp16 and non-float tensors, byte-for-byte
    files_copied: int = 0  # tokenizer, templates, README, …
    bytes_read: int = 0
    bytes_written: int = 0
    clamp: bool = False
    out_of_range: dict[str, int] = field(default_factory=dict)  # tensor -> values beyond ±65504
    underflowed: dict[str, int] = field(default_factory=dict)  # tensor -> non-zero values now 0
    verification: dict | None = None
    elapsed_s: float = 0.0

    @property
    def clamped(self) -> int:
        return sum(self.out_of_range.values()) if self.clamp else 0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "clamped": self.clamped,
            "underflowed_total": sum(self.underflowed.values()),
        }


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # absolute byte offsets in the source file
    end: int

    @property
    def converted(self) -> bool:
        return self.dtype in _CONVERTED

    @property
    def out_size(self) -> int:
        size = self.end - self.begin
        return size // _ITEMSIZE[self.dtype] * 2 if self.converted else size


@dataclass
class _Shard:
    file: Path
    metadata: dict | None
    tensors: list[_Tensor]

    def out_header(self) -> bytes:
        """The clone's safetensors header: same order and metadata, fp16 sizes."""
        header, offset = {}, 0
        if self.metadata is not None:
            header["__metadata__"] = self.metadata
        for t in self.tensors:
            dtype = "F16" if t.converted else t.dtype
            header[t.name] = {"dtype": dtype, "shape": t.shape,
                              "data_offsets": [offset, offset + t.out_size]}
            offset += t.out_size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
        return struct.pack("<Q", len(text)) + text

    @property
    def out_size(self) -> int:
        return len(self.out_header()) + sum(t.out_size for t in self.tensors)


def _read_shard(file: Path) -> _Shard:
    """Parse and sanity-check one source shard's header (offsets, sizes, dtypes)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8 or struct.unpack("<Q", prefix)[0] > size - 8:
            raise InputError(f"{file}: truncated safetensors file")
        length = struct.unpack("<Q", prefix)[0]
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise InputError(f"{file}: corrupt safetensors header") from None
    start = 8 + length
    metadata = header.pop("__metadata__", None)
    tensors = []
    for name, info in header.items():
        dtype, shape = info["dtype"], info["shape"]
        begin, end = (start + offset for offset in info["data_offsets"])
        if dtype.startswith(("F", "BF")) and dtype not in _ITEMSIZE:
            raise InputError(f"{file}: tensor {name} is {dtype}; clone-fp16 converts only "
                             "BF16, F32 and F64 (and keeps F16)")
        expected = math.prod(shape) * _ITEMSIZE.get(dtype, 0)
        if not start <= begin <= end <= size or (dtype in _ITEMSIZE and end - begin != expected):
            raise InputError(f"{file}: tensor {name} has bad data offsets; the file is corrupt")
        tensors.append(_Tensor(name, dtype, shape, begin, end))
    tensors.sort(key=lambda t: t.begin)
    return _Shard(file, metadata, tensors)


class _Writer:
    """Streams the tensors of one shard from its memory map into the output file."""

    def __init__(self, clamp: bool, progress: Callable[[int], None]):
        self.clamp = clamp
        self.progress = progress
        self.converter = Converter(_CHUNK)
        self.out_buf = np.empty(_CHUNK, np.uint16)

    def write_shard(self, shard: _Shard, dest: Path) -> dict[str, RangeCounts]:
        counts = {}
        with open(shard.file, "rb") as source, open(dest, "wb") as out:
            out.write(shard.out_header())
            mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                for tensor in shard.tensors:
                    counts[tensor.name] = self._stream(mapped, tensor, out)
            finally:
                try:
                    mapped.close()
                except BufferError:  # a traceback still holds a view; GC unmaps it
                    pass
            out.flush()
            os.fsync(out.fileno())
        return counts

    def _stream(self, mapped: mmap.mmap, tensor: _Tensor, out) -> RangeCounts:
        counts = RangeCounts()
        step = _WINDOW - _WINDOW % _ITEMSIZE.get(tensor.dtype, 1)
        for begin in range(tensor.begin, tensor.end, step):
            end = min(begin + step, tensor.end)
            if tensor.converted:
                counts.add(self._convert(mapped, tensor.dtype, begin, end, out))
            else:
                with memoryview(mapped) as view, view[begin:end] as window:
                    out.write(window)
            _drop_pages(mapped, begin, end)
            self.progress(end - begin)
        return counts

    def _convert(self, mapped: mmap.mmap, dtype: str, begin: int, end: int, out) -> RangeCounts:
        counts = RangeCounts()
        values = np.frombuffer(mapped, _CONVERTED[dtype], (end - begin) // _ITEMSIZE[dtype], begin)
        try:
            for i in range(0, len(values), _CHUNK):
                chunk = values[i:i + _CHUNK]
                result = self.out_buf[:len(chunk)]
                if dtype == "BF16":
                    counts.add(self.converter.bf16(chunk, result, self.clamp))
                elif dtype == "F32":
                    counts.add(self.converter.f32(chunk, result, self.clamp))
                else:
                    counts.add(f64_to_fp16(chunk, result, self.clamp))
                out.write(result)
                del chunk
        finally:
            del values  # release the map's buffer before the map closes
        return counts


def _drop_pages(mapped: mmap.mmap, begin: int, end: int) -> None:
    """Forget the mapped pages just read, so the clone's RSS does not grow with the file."""
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        start = begin - begin % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _clone_config(src: Path, dest: Path) -> None:
    config = read_config(src)
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in ("torch_dtype", "dtype"):
                if key in section:
                    section[key] = "float16"
    if "torch_dtype" not in config and "dtype" not in config:
        config["torch_dtype"] = "float16"
    from omlx_core import __version__

    config["omlx"] = {
        "fp16_clone": True,
        "source_fingerprint": model_fingerprint(src),
        "omlx_version": __version__,
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (dest / "config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")


def _clone_index(src: Path, dest: Path, shards: list[_Shard]) -> None:
    if not (src / INDEX_FILE).is_file():
        return
    index = json.loads((src / INDEX_FILE).read_text(encoding="utf-8"))
    index.setdefault("metadata", {})["total_size"] = sum(t.out_size for s in shards for t in s.tensors)
    (dest / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n", encoding="utf-8")


def _copy_other_files(src: Path, dest: Path, shard_names: set[str]) -> int:
    """Tokenizer, chat template, generation config, README, licence, …: copied as they are."""
    copied = 0
    for entry in sorted(src.iterdir()):
        if entry.name in shard_names or entry.name in ("config.json", INDEX_FILE):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name)
            copied += sum(1 for p in (dest / entry.name).rglob("*") if p.is_file())
        elif entry.is_file():
            shutil.copy2(entry, dest / entry.name)
            copied += 1
    return copied



def _remove_stale_temps(dst: Path) -> None:
    """Remove temp directories of earlier clones to `dst` whose process is gone."""
    prefix = f".{dst.name}{_TMP_TAG}"
    if not dst.parent.is_dir():
        return
    for entry in dst.parent.iterdir():
        pid = entry.name[len(prefix):]
        if entry.name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    src_real, dst_real = src.resolve(), dst.resolve()
    if dst_real == src_real:
        raise InputError(f"{dst}: DST is SRC; the source is never modified, "
                         "give a new directory for the clone")
    if dst_real.is_relative_to(src_real):
        raise InputError(f"{dst}: DST is inside SRC ({src_real}); choose a directory outside it")
    if src_real.is_relative_to(dst_real):
        raise InputError(f"{dst}: SRC ({src_real}) is inside DST; replacing DST would delete "
                         "the source, choose another DST")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise InputError(f"{dst} already exists; pass --force to replace it once the new "
                         "clone succeeded, or choose another DST")


@contextmanager
def _sigterm_raises():
    """Turn SIGTERM into Terminated (main thread only), so cleanup runs like on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough; let cleanup finish
        raise Terminated("terminated by SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_blocked():
    """Hold Ctrl-C and SIGTERM for the few renames that swap the clone into place."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _move_into_place(tmp: Path, dst: Path) -> None:
    with _signals_blocked():
        if dst.exists() or dst.is_symlink():
            old = dst.parent / f".{dst.name}{_OLD_TAG}{os.getpid()}"
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except BaseException:
                os.rename(old, dst)
                raise
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.rename(tmp, dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _range_error(report: CloneReport) -> OmlxError:
    worst = sorted(report.out_of_range.items(), key=lambda item: -item[1])
    named = ", ".join(f"{name} ({count})" for name, count in worst[:8])
    more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
    return OmlxError(
        f"{report.source}: {sum(report.out_of_range.values())} values in {len(worst)} tensors are "
        f"outside the float16 range ±65504 and would become inf: {named}{more}; "
        "rerun with --clamp to saturate them"
    )


def _source_path(src) -> Path:
    return Path(getattr(src, "path", src)).expanduser()


def clone_fp16(src, dst, *, force: bool = False, clamp: bool = False, verify: bool = True,
               verify_tokens: int = 32, progress: Progress | None = None) -> CloneReport:
    """Write an fp16 clone of checkpoint `src` (a path or ModelRef) to directory `dst`.

    InputError for a bad SRC/DST; OmlxError when values are out of the fp16 range (unless
    `clamp`) or the clone fails verification. On any failure DST is left as it was.
    """
    started = time.monotonic()
    src, dst = _source_path(src), Path(dst).expanduser()
    check_checkpoint(src)
    if verify_tokens < 1:
        raise InputError(f"--verify-tokens must be at least 1, not {verify_tokens}")
    _check_destination(src, dst, force)
    _remove_stale_temps(dst)
    shards = [_read_shard(file) for file in weight_files(src)]
    report = CloneReport(str(src), str(dst), model_fingerprint(src), clamp=clamp, shards=len(shards))
    total = sum(t.end - t.begin for s in shards for t in s.tensors)
    dst.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(s.out_size for s in shards)
    free = shutil.disk_usage(dst.parent).free
    if needed > free:
        raise OmlxError(f"{dst.parent}: the clone needs {needed} bytes but only {free} are free")
    notify = progress or (lambda stage, done, total: None)
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        notify("convert", done, total)

    tmp = dst.parent / f".{dst.name}{_TMP_TAG}{os.getpid()}"
    with _sigterm_raises():
        try:
            tmp.mkdir()
            notify("convert", 0, total)
            writer = _Writer(clamp, advance)
            for shard in shards:
                counts = writer.write_shard(shard, tmp / shard.file.name)
                report.bytes_written += shard.out_size
                for tensor in shard.tensors:
                    report.tensors_converted += tensor.converted
                    report.tensors_copied += not tensor.converted
                    if counts[tensor.name].overflow:
                        report.out_of_range[tensor.name] = counts[tensor.name].overflow
                    if counts[tensor.name].underflow:
                        report.underflowed[tensor.name] = counts[tensor.name].underflow
            report.bytes_read = total
            if report.out_of_range and not clamp:
                raise _range_error(report)
            report.files_copied = _copy_other_files(src, tmp, {s.file.name for s in shards})
            _clone_index(src, tmp, shards)
            _clone_config(src, tmp)
            report.fingerprint = model_fingerprint(tmp)
            if verify:
                from omlx_core.models.verify import compare_greedy

                notify("verify", 0, verify_tokens)
                result = compare_greedy(src, tmp, steps=verify_tokens)
                report.verification = result.to_dict()
                if result.status == "failed":
                    raise OmlxError(f"{dst}: the clone failed verification: {result.reason}; "
                                    "nothing was written")
                notify("verify", verify_tokens, verify_tokens)
            _move_into_place(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    report.elapsed_s = round(time.monotonic() - started, 3)
    return report


def is_fp16_clone(model) -> bool:
    """True when every floating tensor is fp16: a path or ModelRef (headers only) or a module.

    The prefill planner asks this to decide whether the CPU lane may share the work.
    """
    if hasattr(model, "parameters") and callable(model.parameters):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        return all(value.dtype == mx.float16 for _, value in tree_flatten(model.parameters())
                   if mx.issubdtype(value.dtype, mx.floating))
    tensors = tensor_index(_source_path(model))
    return bool(tensors) and all(info["dtype"] == "F16" for info in tensors.values()
                                 if info["dtype"].startswith(("F", "BF")))
