"""Model fingerprint: identity of a checkpoint's layout, used to gate kernels and profiles.

It covers model_type, quantization and every tensor's name, shape and dtype: equal for two
copies of a checkpoint, different once a layer's shape, dtype or quantization changes.
Weight values are not read, so it costs only the safetensors headers.
"""

import hashlib
import json
from pathlib import Path

from omlx_core.models.checkpoint import read_config, tensor_index


def model_fingerprint(path: Path) -> str:
    config = read_config(path)
    tensors = {name: [info["dtype"], info["shape"]] for name, info in tensor_index(path).items()}
    keyed = {
        "model_type": config["model_type"],
        "quantization": config.get("quantization"),
        "tensors": tensors,
    }
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    return "mf-" + digest[:16]


def model_summary(path: Path) -> dict:
    """What `omlx models info` shows: architecture, size, quantization, dtypes."""
    config = read_config(path)
    tensors = tensor_index(path)
    dtypes: dict[str, int] = {}
    for info in tensors.values():
        dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + 1
    text = config.get("text_config", config)
    return {
        "model_type": config["model_type"],
        "layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "quantization": config.get("quantization"),
        "tensor_count": len(tensors),
        "tensor_dtypes": dtypes,
        "size_bytes": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")),
        "shards": len(list(Path(path).glob("*.safetensors"))),
        "fingerprint": model_fingerprint(path),
    }
