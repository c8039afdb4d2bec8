"""Loading a safetensors folder: the model's tensors are its own memory, not views of the file."""
import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch

from forerun.models.loader import load_model
from tests.tiny import tiny_model


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def _saved_tiny(folder: Path) -> tuple[torch.nn.Module, Path]:
    """A tiny random llama saved as a safetensors folder (config.json, model.safetensors):
    the model and its weights file."""
    from safetensors.torch import save_file

    source = tiny_model(seed=0, dtype="float32")
    cfg = {k: v for k, v in dataclasses.asdict(source.config).items() if isinstance(v, (int, float, str, bool))}
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    weights = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "inv_freq"}, str(weights))
    return source, weights


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_loaded_weights_do_not_stay_mapped_from_the_file(tmp_path):
    """safetensors maps the file; a tensor kept as it is (an embedding table, a float32
    weight) would be page cache the kernel may evict while it sits cold, and a later lookup
    would read the disk. Every tensor must be a copy, and the mapping gone once loaded."""
    source, weights = _saved_tiny(tmp_path)
    model = load_model(tmp_path, "float32")
    gc.collect()
    assert not _mapped(weights)
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)


def test_a_load_does_not_import_torch_dynamo(tmp_path):
    """Built on the meta device, a model whose init ran torch's Python references (normal_,
    arange) imported torch._dynamo on their first call: 1.1-1.7 s of every start. A fresh
    interpreter loads a saved model, and the module must still be absent after."""
    import subprocess
    import sys

    _saved_tiny(tmp_path)
    code = ("import sys; from pathlib import Path; from forerun.models.loader import load_model; "
            f"load_model(Path({str(tmp_path)!r}), 'float32'); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
