"""The typed settings schema: every key omlx reads, its type, default and meaning.

A key is `section.name`. Values come from the command line and the environment as
text (`parse`) and from JSON files as JSON values (`validate`); both give the same
typed value or an InputError that names the key, what it expects and close matches.
"""

import difflib
from dataclasses import dataclass
from typing import Any

from omlx_core.errors import InputError
from omlx_core.units import parse_count, parse_memory

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Setting:
    key: str
    kind: str  # str | int | float | bool | count | memory | choice | list
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    secret: bool = False

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def env_name(self) -> str:
        return "OMLX_" + self.key.replace(".", "_").upper()

    @property
    def expects(self) -> str:
        """What a valid value looks like, for error messages and help."""
        described = {
            "str": "a string",
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "count": "a length such as 4096 or 16k",
            "memory": "a memory size such as 8GB, 512MiB or a fraction such as 0.9",
            "choice": "one of " + ", ".join(self.choices),
            "list": "a comma-separated list"
            + (" of " + ", ".join(self.choices) if self.choices else ""),
        }[self.kind]
        if self.minimum is not None and self.maximum is not None:
            described += f" in [{self.minimum:g}, {self.maximum:g}]"
        elif self.minimum is not None:
            described += f" ≥ {self.minimum:g}"
        return described + (" (or none)" if self.nullable else "")

    def _bad(self, value: Any) -> InputError:
        return InputError(f"{self.key}: invalid value {value!r}; expected {self.expects}")

    def parse(self, text: str) -> Any:
        """A value typed by a person (CLI argument or environment variable)."""
        raw = text.strip()
        if self.nullable and raw.lower() in ("", "none", "null"):
            return None
        try:
            if self.kind == "bool":
                if raw.lower() in _TRUE:
                    return True
                if raw.lower() in _FALSE:
                    return False
                raise self._bad(text)
            if self.kind == "int":
                return self.validate(int(raw))
            if self.kind == "float":
                return self.validate(float(raw))
            if self.kind == "count":
                return self.validate(parse_count(raw, self.key))
            if self.kind == "memory":
                return self.validate(parse_memory(raw, self.key))
            if self.kind == "list":
                return self.validate([item.strip() for item in raw.split(",") if item.strip()])
        except (ValueError, InputError):
            raise self._bad(text) from None
        return self.validate(raw)

    def validate(self, value: Any) -> Any:
        """A value read from a JSON file; returns it normalized or raises InputError."""
        if value is None:
            if self.nullable:
                return None
            raise self._bad(value)
        kind = self.kind
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind in ("int", "count"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif kind == "memory":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            ok = ok and (isinstance(value, int) or value <= 1)
        elif kind == "choice":
            ok = value in self.choices
        elif kind == "list":
            ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
            ok = ok and (not self.choices or all(item in self.choices for item in value))
        else:
            ok = isinstance(value, str)
        if ok and kind in ("int", "float", "count"):
            ok = (self.minimum is None or value >= self.minimum) and (
                self.maximum is None or value <= self.maximum
            )
        if not ok:
            raise self._bad(value)
        return list(value) if kind == "list" else value

    def show(self, value: Any) -> str:
        """A value as text, secrets masked."""
        if self.secret and value:
            return "****"
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, list):
            return ",".join(value)
        return str(value)


def share_setting(key: str, what: str) -> Setting:
    """A lane's share of one split target's output channels (0..1, default 0.25)."""
    return Setting(key, "float", 0.25, what, minimum=0.0, maximum=1.0)


def kernel_setting(name: str, what: str) -> Setting:
    """The auto|on|off switch of registered kernel `name` (omlx_core.kernels.catalog)."""
    return Setting(f"kernels.{name}", "choice", "auto",
                   f"Custom kernel for {what}: auto = only where validated (model and hardware); "
                   "on = also unvalidated (experimental, warns); off = mlx-lm's ops.",
                   choices=("auto", "on", "off"))


SETTINGS: tuple[Setting, ...] = (
    Setting("server.host", "str", "127.0.0.1", "Address omlx serve listens on."),
    Setting("server.port", "int", 8000, "TCP port omlx serve listens on.", minimum=1, maximum=65535),
    Setting("server.api_key", "str", None, "Bearer key clients must send; none disables auth.",
            nullable=True, secret=True),
    Setting("server.max_concurrency", "int", 8, "Requests decoded together in one batch.", minimum=1),
    Setting("server.max_queue", "int", 64, "Requests waiting beyond the batch before 503.", minimum=0),
    Setting("server.prefill_batch", "int", 32,
            "Most admitted prompts prefilled together in one engine step (at most max_concurrency); "
            "the step's prompts x longest chunk also stay within server.prefill_tokens.", minimum=1),
    Setting("server.prefill_tokens", "count", 0,
            "Most prompt tokens one engine step prefills (its prompts x their longest chunk), as vLLM's "
            "max_num_batched_tokens; each prompt's chunk stays within prefill.chunk_size. 0 = auto: "
            "twice prefill.chunk_size on CUDA (measured faster at 32 streams), prefill.chunk_size elsewhere.",
            minimum=0),
    Setting("server.warmup", "bool", True,
            "Before serving, decode dummy batches of 1 sequence, of each decode-kernel launch shape and of "
            "max_concurrency, so the first requests do not wait for kernel compiles."),
    Setting("prompt_cache.enabled", "bool", True,
            "Reuse computed KV of repeated prompt prefixes across requests and restarts."),
    Setting("prompt_cache.memory_bytes", "memory", 0.10,
            "Memory the prompt cache keeps hot blocks in (a size or a share of memory)."),
    Setting("prompt_cache.disk", "bool", True,
            "Also keep blocks on SSD under $OMLX_HOME/cache, so they survive a restart."),
    Setting("prompt_cache.disk_bytes", "memory", "10GB",
            "Space the SSD tier may use per model (a size or a share of the disk); LRU beyond it."),
    Setting("prompt_cache.block_tokens", "count", 256,
            "Tokens per cache block: prefixes are reused in whole blocks.", minimum=16),
    Setting("prompt_cache.writer_memory", "memory", 0.10,
            "Memory pending SSD writes may hold (a size or a share); past it new spills are dropped."),
    Setting("prompt_cache.writer_min_blocks", "int", 2,
            "Pending SSD writes always accepted, even past prompt_cache.writer_memory.", minimum=1),
    Setting("prompt_cache.writer_max_blocks", "int", 256,
            "Most pending SSD writes, whatever their size.", minimum=1),
    Setting("memory.soft_watermark", "memory", 0.80,
            "Above this share of memory, new requests wait for running ones to finish."),
    Setting("memory.hard_watermark", "memory", 0.90,
            "A request whose KV cache would cross this is refused with 507."),
    Setting("prefill.chunk_size", "count", 2048, "Prompt tokens processed per prefill step.",
            minimum=16),
    Setting("prefill.lanes", "list", ["gpu"], "Compute lanes prefill may split linears across.",
            choices=("gpu", "cpu", "ane")),
    Setting("prefill.cpu_sharing.enabled", "bool", False,
            "Experimental: run a share of prefill projections on the CPU lane (FP16 clones only)."),
    share_setting("prefill.cpu_share.mlp_gate_up",
                  "Share of MLP gate/up output channels the CPU lane computes during prefill."),
    share_setting("prefill.cpu_share.mlp_down",
                  "Share of MLP down-projection output channels the CPU lane computes during prefill."),
    share_setting("prefill.cpu_share.gdn_qkv",
                  "Share of gated-delta qkv output channels the CPU lane computes (hybrid models)."),
    share_setting("prefill.ane_share.mlp_gate_up",
                  "Share of MLP gate/up output channels the ANE lane computes (INT8, approximate; Apple Silicon)."),
    share_setting("prefill.ane_share.mlp_down",
                  "Share of MLP down-projection output channels the ANE lane computes (INT8, approximate)."),
    share_setting("prefill.ane_share.gdn_qkv",
                  "Share of gated-delta qkv output channels the ANE lane computes (hybrid models; INT8)."),
    Setting("prefill.ane.tokens", "count", 512,
            "Rows of the ANE procedures' fixed input shape; longer inputs run in chunks of it.",
            minimum=16),
    Setting("prefill.ane.dual", "choice", "auto",
            "Split each ANE procedure into two banks, one per Neural Engine; auto = on for Ultra chips.",
            choices=("auto", "on", "off")),
    Setting("prefill.ane.max_error", "float", 0.02,
            "The tuner rejects ANE shares whose INT8 banks' output error (relative RMS) exceeds this.",
            minimum=0.0),
    Setting("prefill.split_min_tokens", "count", 256,
            "Inputs of at least this many tokens are split across lanes; smaller ones (decode) are not.",
            minimum=1),
    Setting("chat.reasoning_effort", "str", None,
            "Reasoning effort passed to chat templates that take one, when a request gives none.",
            nullable=True),
    Setting("chat.reasoning_effort_custom", "str", None,
            "The value sent when the effort is `custom` (e.g. a token budget the template knows).",
            nullable=True),
    Setting("chat.reasoning_effort_force", "bool", False,
            "Use chat.reasoning_effort even when a request asks for another effort."),
    Setting("prefill.dense", "choice", "auto",
            "Dequantize quantized linears to dense for large prefill inputs (parity-keeping); "
            "auto = on where measured to win (CUDA).", choices=("auto", "on", "off")),
    Setting("compute.upcast_quantized", "choice", "auto",
            "Multiply 16-bit quantized layers in float32 (parity-keeping; MLX's 16-bit quantized CPU "
            "kernel is 10-50x slower); auto = on on MLX's CPU backend.", choices=("auto", "on", "off")),
    Setting("prefill.dense_min_tokens", "count", 65,
            "Inputs of at least this many tokens take the dequantize-to-dense path (65: right above the "
            "decode kernel's 64; below, MLX's quantized matmul, which CUDA compiles per input shape).",
            minimum=1),
    Setting("prefill.small_attention_scores", "int", 1 << 25,
            "A prefill attention whose scores (batch x heads x queries x keys) hold at most this many "
            "elements runs unfused, so CUDA builds no cuDNN graph for each new prompt batch shape "
            "(llama/qwen2/qwen3 with kernels.sdpa_decode); 0: MLX's fused attention always.", minimum=0),
    Setting("prefill.chunked_gdn", "bool", True,
            "Prefill gated-delta layers (qwen3_5) in chunks instead of token by token (parity-keeping)."),
    Setting("prefill.chunked_gdn_min_tokens", "count", 64,
            "Inputs of at least this many tokens use the chunked gated-delta prefill.", minimum=1),
    kernel_setting("indexer_score", "the deepseek_v41 indexer score (fused, no per-head tensor)"),
    kernel_setting("qmm_decode", "quantized linears at 1..64 tokens (decode), weights streamed once"),
    kernel_setting("dequantize", "the dense prefill path's dequantize, at HBM bandwidth"),
    kernel_setting("sdpa_decode", "attention at one token per sequence (decode), each K/V head read once"),
    kernel_setting("qk_norm_rope", "decode attention's q/k norms and RoPE in one launch (with sdpa_decode)"),
    kernel_setting("decode_block", "a decoder layer's one-token step compiled around its attention, the residual "
                   "adds inside qmm_decode's launches"),
    Setting("compute.dense_copy", "choice", "auto",
            "Keep a dense copy of every quantized weight (charged to the memory guard): float32 for every "
            "input on MLX's CPU backend, the scales' dtype for decode-sized inputs (1..64 tokens) elsewhere; "
            "auto = on on the CPU backend with an optimized BLAS when the copies fit in a quarter of memory.",
            choices=("auto", "on", "off")),
    Setting("models.default", "str", "default", "Model used when a command names none."),
    Setting("models.pinned", "list", [], "Models omlx serve keeps loaded."),
    Setting("cluster.enabled", "bool", False, "Experimental: distributed inference over enrolled workers."),
    Setting("cluster.address", "str", None,
            "Address workers see this controller's SSH logins come from (default: this host's IP).",
            nullable=True),
    Setting("cluster.ssh_dir", "str", "~/.ssh",
            "The worker's SSH directory whose authorized_keys `omlx cluster join` edits."),
    Setting("cluster.ssh_host", "str", None,
            "Address the controller reaches this worker's sshd on (default: the address it joined from).",
            nullable=True),
    Setting("cluster.ssh_port", "int", 22, "Port of this worker's sshd.", minimum=1, maximum=65535),
    Setting("cluster.ssh_user", "str", None, "User the controller logs in as (default: the joining user).",
            nullable=True),
    Setting("cluster.host_key_files", "list", ["/etc/ssh/ssh_host_ed25519_key.pub"],
            "This worker's sshd host public keys, pinned by the controller at join."),
    Setting("cluster.verify_timeout_s", "float", 10.0,
            "Bound on each verification step (SSH login, version probe, collective check).",
            minimum=0.5),
    Setting("cluster.ring_port", "int", 32323,
            "First TCP port of the ring backend (one per rank).", minimum=1024, maximum=65000),
    Setting("logging.level", "choice", "warning", "Log verbosity.",
            choices=("debug", "info", "warning", "error")),
    Setting("logging.file", "str", None, "Also append logs to this file.", nullable=True),
)

BY_KEY: dict[str, Setting] = {setting.key: setting for setting in SETTINGS}
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(setting.section for setting in SETTINGS))


def lookup(key: str) -> Setting:
    """The setting for a dotted key, or an InputError that suggests close matches."""
    if key in BY_KEY:
        return BY_KEY[key]
    close = difflib.get_close_matches(key, BY_KEY, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see `omlx settings show`"
    raise InputError(f"unknown setting {key!r}{hint}")


def defaults() -> dict[str, Any]:
    return {setting.key: setting.default for setting in SETTINGS}
