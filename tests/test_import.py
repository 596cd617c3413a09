"""`import metrale` is fast and torch/CuPy-free, and every public subpackage is reachable
as an attribute afterwards (issue 14 item 9)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, time
t = time.perf_counter()
import metrale
dt = time.perf_counter() - t
numpy_at_import = "numpy" in sys.modules
heavy = sorted(m for m in ("torch", "cupy", "tokenizers", "jinja2", "ml_dtypes", "safetensors")
               if m in sys.modules)
mel = metrale.audio.log_mel_spectrogram
gen = metrale.engine.generate
assert metrale.engine.transcribe.transcribe.__name__ == "transcribe"
names = [metrale.formats.open_source.__name__, metrale.gpu_runtime.HostBackend.__name__,
         metrale.kv.CacheConfig.__name__, metrale.generative.GenerativeModel.__name__,
         metrale.model_engine.TransformerModel.__name__, metrale.whisper.WhisperModel.__name__,
         metrale.vision.preprocess_image.__name__, metrale.ops.__name__,
         metrale.api.load.__name__, metrale.CacheConfig.__name__]
print(json.dumps({"seconds": dt, "numpy": numpy_at_import, "heavy": heavy, "mel": mel.__name__, "gen": gen.__name__,
                  "names": names, "torch_after": "torch" in sys.modules}))
"""


def _probe() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_subpackages_after_a_plain_import():
    d = _probe()
    assert d["mel"] == "log_mel_spectrogram" and d["gen"] == "generate"
    assert len(d["names"]) == 10 and not d["torch_after"]


def test_lazy_subpackages_respect_the_layer_order():
    """The package __init__ reaches its SUBMODULES through importlib, which the layering
    test's import reader cannot see: check them against its table here."""
    import metrale
    from tests.test_layers import LAYERS

    def layer(mod):
        best = max((k for k in LAYERS if mod == k or mod.startswith(k + ".")), key=len)
        return LAYERS[best]
    for name in metrale.SUBMODULES:
        assert layer(f"metrale.{name}") <= LAYERS["metrale"], name


def test_import_is_fast_and_light():
    d = _probe()
    assert d["heavy"] == [], d["heavy"]
    assert not d["numpy"], "import metrale imports numpy (the CLI's first lines must be light)"
    # numpy is the only third-party import; 1 s leaves room for a loaded CI machine
    assert d["seconds"] < 1.0, d["seconds"]


def test_unknown_attribute_is_an_attribute_error():
    import metrale
    try:
        metrale.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
    assert "engine" in dir(metrale)
