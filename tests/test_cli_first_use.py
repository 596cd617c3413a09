"""The command line as a new user meets it, second pass (issue 29 §3; issue 27's positional
prompt): hf download hints, --device emu, progress on stderr, bench rows as they finish and
after Ctrl-C, context limits said by name, info's MODEL and units, several audio files,
sampling flags without a temperature, ppl's encodings and empty files, embed's length
limit, --version, Ctrl-C in generate, check-kernels' help, and LLaVA images."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from metrale.cli import main
from tests.test_cli_end_to_end import stereo_float_wav
from tests.test_cli_paths import FIXTURES, checkpoint

ROOT = Path(__file__).resolve().parents[1]


def err_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("metrale: error:"), err
    return err[0]


# ---------------------------------------------------------------------- packaging, version
def test_license_is_an_spdx_expression():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT OR Apache-2.0"$', text, re.M)
    # PEP 639 strings need setuptools 77 in the isolated build environment
    need = re.search(r'^requires = \[.*"setuptools>=(\d+)"', text, re.M)
    assert need and int(need.group(1)) >= 77


def test_version(capsys):
    import metrale
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"metrale {metrale.__version__}"


def test_check_kernels_help_has_a_description(capsys):
    assert main(["check-kernels", "--help"]) == 0
    out = capsys.readouterr().out
    assert "NVRTC" in out and "registers" in out and "without a GPU" in out


# -------------------------------------------------------------------------- --device emu
def test_device_emu_on_every_command_that_takes_device(capsys):
    from metrale.cli import build_parser
    parser = build_parser()
    for argv in (["bench", "preset:tiny"], ["generate", "preset:tiny", "--ids", "1"],
                 ["ppl", "preset:tiny", "--ids", "1,2"], ["embed", "preset:tiny", "--ids", "1"],
                 ["transcribe", "preset:tiny", "a.wav"]):
        assert parser.parse_known_args(argv + ["--device", "emu"])[0].device == "emu"
    # the same tokens as the CPU twins: the kernels' own sources ran
    assert main(["generate", "preset:tiny", "--ids", "1,2", "--max-new-tokens", "2",
                 "--device", "emu"]) == 0
    emu = capsys.readouterr().out
    assert main(["generate", "preset:tiny", "--ids", "1,2", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == emu


# --------------------------------------------------------------------------- generate
def test_prompt_positionally(tmp_path, capsys):
    d = checkpoint(tmp_path)
    common = ["--max-new-tokens", "4", "--ignore-eos", "--device", "cpu"]
    assert main(["generate", str(d), "--prompt", "Hello there"] + common) == 0
    want = capsys.readouterr()
    for argv in (["generate", str(d), "Hello there"] + common,
                 ["generate", "--model", str(d), "Hello there"] + common,
                 ["generate", str(d)] + common + ["Hello there"]):   # after the options
        assert main(argv) == 0
        got = capsys.readouterr()
        assert got.out == want.out and "4 tokens" in got.err
    assert main(["generate", str(d), "Hi", "--prompt", "Hi"]) == 2
    assert "give the prompt once" in err_line(capsys)
    assert main(["generate", str(d), "Hi", "extra"]) == 2
    assert "quote a prompt" in err_line(capsys)
    assert main(["generate", str(d), "Hi", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in err_line(capsys)


def test_sampling_flags_without_a_temperature(tmp_path, capsys):
    base = ["generate", "preset:tiny", "--ids", "1,2", "--max-new-tokens", "2",
            "--device", "cpu"]
    # no generation_config.json: vLLM's default temperature 1
    assert main(base + ["--top-p", "0.9", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert "--top-p and --seed given without --temperature: sampling at temperature 1 " \
           "(vLLM's default" in err
    assert "temperature 1, top_k 0, top_p 0.9" in err
    # temperature 0 keeps greedy decoding and says the flags are ignored
    assert main(base + ["--temperature", "0", "--top-k", "5"]) == 0
    err = capsys.readouterr().err
    assert "--top-k ignored: temperature 0 decodes greedily" in err and "greedy" in err
    # a generation_config.json temperature without do_sample: that temperature
    d = checkpoint(tmp_path, tokenizer=False, gen={"temperature": 0.7, "do_sample": False})
    assert main(["generate", str(d), "--ids", "1,2", "--max-new-tokens", "2", "--top-k", "5",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "temperature 0.7 (generation_config.json's temperature" in err
    assert "temperature 0.7, top_k 5" in err
    # nothing given: generation_config.json's greedy decoding, and no note
    assert main(["generate", str(d), "--ids", "1,2", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "greedy" in err and "metrale:" not in err


def test_max_seq_len_lowered_is_said(capsys):
    assert main(["generate", "preset:tiny", "--ids", "1,2", "--max-new-tokens", "1",
                 "--max-seq-len", "100000", "--device", "cpu"]) == 0
    assert "metrale: --max-seq-len 100000 lowered to 2048: the checkpoint's context is " \
           "2048 positions (max_position_embeddings)" in capsys.readouterr().err
    assert main(["generate", "preset:tiny", "--ids", "1,2", "--max-new-tokens", "1",
                 "--max-seq-len", "64", "--device", "cpu"]) == 0
    assert "lowered" not in capsys.readouterr().err


def test_ctrl_c_ends_the_streamed_line(tmp_path, capsys, monkeypatch):
    import metrale.engine

    def interrupted(model, ids, max_new, sampling, stop_token_ids=None, on_token=None,
                    images=None):
        for t in (40, 41, 42):
            on_token(t)
        raise KeyboardInterrupt
    monkeypatch.setattr(metrale.engine, "generate", interrupted)
    d = checkpoint(tmp_path)
    assert main(["generate", str(d), "Hello", "--device", "cpu"]) == 130
    out = capsys.readouterr()
    assert out.out.endswith("\n") and out.out.count("\n") == 1
    # one line (a note and main's line were two)
    assert out.err.splitlines() == ["metrale: interrupted after 3 tokens"], out.err


# ------------------------------------------------------------------------------- info
def test_info_model_argument_context_and_units(capsys):
    d = FIXTURES / "llama_gqa"            # 512 positions, 106,816 parameters
    assert main(["info", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "parameters     106,816 (106.8 K)" in out
    assert "for batch 1 x 512 tokens" in out          # not 4,096 on a 512-position model
    assert main(["info", "preset:llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "(8.03 B)" in out and "x 4,096 tokens" in out
    assert main(["info", str(d), "--context", "100000"]) == 1
    line = err_line(capsys)
    assert "--context 100000" in line and "512 positions" in line
    assert main(["info", str(d), "--context", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 512
    assert main(["info", "--help"]) == 0
    usage = capsys.readouterr().out
    assert "MODEL" in usage and "DIR" not in usage and "--model" in usage
    assert main(["info", str(d), "--model", str(d)]) == 2
    assert "not both" in err_line(capsys)


# -------------------------------------------------------------------------- ppl, embed
def test_ppl_encodings_and_short_texts(tmp_path, capsys):
    d = checkpoint(tmp_path)
    text = "Café au lait, the cat sat on the mat.\n"
    (tmp_path / "utf8.txt").write_bytes(text.encode("utf-8"))
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (tmp_path / "empty.txt").write_bytes(b"")

    def ppl(name, *extra):
        return main(["ppl", str(d), "--text", str(tmp_path / name), "--json", "--device",
                     "cpu", *extra])
    assert ppl("utf8.txt") == 0
    want = json.loads(capsys.readouterr().out)
    assert ppl("latin1.txt") == 1
    line = err_line(capsys)
    assert "latin1.txt: not valid utf-8 at byte offset 3" in line and "--encoding" in line
    for name, extra in (("latin1.txt", ("--encoding", "latin-1")), ("bom.txt", ())):
        assert ppl(name, *extra) == 0
        got = json.loads(capsys.readouterr().out)
        assert (got["tokens"], got["perplexity"]) == (want["tokens"], want["perplexity"])
    assert ppl("empty.txt") == 1
    assert "empty.txt is empty" in err_line(capsys)
    assert ppl("utf8.txt", "--encoding", "klingon") == 2
    assert "unknown encoding 'klingon'" in err_line(capsys)
    assert main(["ppl", str(d), "--ids", "5", "--device", "cpu"]) == 1
    assert "--ids gives 1 token; perplexity needs at least 2" in err_line(capsys)


def test_embed_max_seq_len_and_its_error(capsys):
    long = ",".join(["5"] * 600)
    d = str(FIXTURES / "llama_gqa")
    assert main(["embed", d, "--ids", "1,2", "--ids", long, "--device", "cpu"]) == 1
    line = err_line(capsys)
    assert "--ids input 2 is 600 tokens, longer than the model's context of 512 tokens" in line
    assert "max_position_embeddings" in line and "seq_len" not in line
    assert main(["embed", d, "--ids", ",".join(["5"] * 40), "--max-seq-len", "32",
                 "--device", "cpu"]) == 1
    assert "longer than --max-seq-len 32: raise it (up to 512)" in err_line(capsys)
    assert main(["embed", d, "--ids", "1,2,3", "--max-seq-len", "32", "--json",
                 "--device", "cpu"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1


# ------------------------------------------------------------------------------ bench
BENCH = ["bench", "preset:tiny", "--device", "cpu", "--prompt-len", "8", "--gen-len", "2",
         "--warmup", "0"]


def test_bench_json_to_stdout_and_rows_as_they_finish(capsys, monkeypatch, tmp_path):
    from metrale.bench import harness
    real, seen = harness._run_batch, []

    def spy(*a, **k):   # what was written when each batch size starts
        seen.append(capsys.readouterr())
        return real(*a, **k)
    monkeypatch.setattr(harness, "_run_batch", spy)
    assert main(BENCH + ["--batch", "1,2"]) == 0
    out = capsys.readouterr()
    # batch 1's row was out before batch 2 ran; a progress line per batch on stderr
    assert re.search(r"^\s+1\s+[\d,.]+", seen[1].out, re.M) and "decode tok/s" in seen[1].out
    assert "metrale bench: [1/2] batch 1" in seen[1].err
    assert re.search(r"^\s+2\s+[\d,.]+", out.out, re.M) and "[2/2] batch 2" in out.err
    assert main(BENCH + ["--batch", "1", "--json", "-"]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)                       # stdout is the JSON alone
    assert [r["batch"] for r in d["results"]] == [1] and "decode tok/s" in out.err
    assert not (tmp_path / "-").exists() and not Path("-").exists()


def test_an_interrupted_bench_keeps_its_finished_rows(capsys, monkeypatch, tmp_path):
    from metrale.bench import harness
    real, calls = harness._run_batch, []

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(harness, "_run_batch", interrupt_second)
    out_json = tmp_path / "b.json"
    assert main(BENCH + ["--batch", "1,2,4", "--json", str(out_json)]) == 130
    out = capsys.readouterr()
    assert re.search(r"^\s+1\s+[\d,.]+", out.out, re.M)
    assert "interrupted: 1 of 3 batch sizes finished" in out.out
    assert "bench interrupted: 1 of 3 batch sizes finished" in out.err
    d = json.loads(out_json.read_text())
    assert d["interrupted"] is True and [r["batch"] for r in d["results"]] == [1]


# ------------------------------------------------------------------------ check-kernels
def test_check_kernels_progress_on_stderr(capsys, monkeypatch):
    from metrale.gpu_runtime import kernel_source

    def fake_check_all(archs, on_record=None):
        recs = [{"file": f"k{i}.cu", "arch": a, "ok": True, "kernels": [], "error": None}
                for i in range(2) for a in archs]
        for i, r in enumerate(recs, 1):
            on_record(r, i, len(recs))
        return recs
    monkeypatch.setattr(kernel_source, "check_all", fake_check_all)
    assert main(["check-kernels", "--json", "--arch", "sm_90"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)) == 2
    assert "metrale check-kernels: [1/2] k0.cu sm_90" in out.err
    assert "metrale check-kernels: [2/2] k1.cu sm_90" in out.err


# ------------------------------------------------------------------------- transcribe
def test_transcribe_several_files_with_progress(tmp_path, capsys):
    import metrale
    from metrale.engine.transcribe import transcribe
    d = checkpoint(tmp_path, "whisper_tiny")
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    stereo_float_wav(a, seconds=1.0)
    stereo_float_wav(b, seconds=31.0)             # two 30 s windows
    common = ["--language", "en", "--max-new-tokens", "3", "--device", "cpu"]
    assert main(["transcribe", str(d), str(a), str(b), "--json"] + common) == 0
    out = capsys.readouterr()
    rows = [json.loads(ln) for ln in out.out.splitlines()]
    assert [r["file"] for r in rows] == [str(a), str(b)]
    m = metrale.load(d, "cpu", progress=False)
    for r, f in zip(rows, (a, b)):
        assert r["tokens"] == transcribe(m, metrale.audio.load_wav(f), language="en",
                                         max_new_tokens=3).tokens
    assert len(rows[1]["segments"]) == 2
    prog = [ln for ln in out.err.splitlines() if ln.startswith("metrale transcribe:")]
    assert len(prog) == 3 and "[3/3]" in prog[-1] and "30.0-31.0 s" in prog[-1]
    # text: one line per file, prefixed with its name; --model with the files after it
    assert main(["transcribe", str(a), str(b), "--model", str(d)] + common) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(": ", 1)[0] for ln in lines] == [str(a), str(b)]
    assert lines[0].split(": ", 1)[1] == rows[0]["text"]


# ------------------------------------------------------------------------------ LLaVA
@pytest.fixture()
def llava(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image
    d = checkpoint(tmp_path, "llava_tiny")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)).save(tmp_path / "b.png")
    return d, tmp_path / "a.png", tmp_path / "b.png"


def greedy_with_images(d, ids, pngs, n):
    """The pointer API by hand: encode_images, prefill_multimodal, then decode."""
    import metrale
    from metrale.vision import ImageProcessorConfig, load_image, preprocess_image
    m = metrale.load(d, "cpu", progress=False)
    cfg = ImageProcessorConfig.from_pretrained(d)
    imgs = [preprocess_image(load_image(p), cfg) for p in pngs]
    seq = m.alloc_sequence()
    t = m.argmax_on_device(m.prefill_multimodal(ids, m.encode_images(imgs, 0), seq, 0), 0)
    out = [t]
    while len(out) < n:
        out.append(m.argmax_on_device(m.decode(out[-1], seq, 0), 0))
    m.teardown()
    return out


def test_generate_with_images(llava, capsys):
    from tokenizers import Tokenizer
    d, a, b = llava
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    F, img = 16, 255                                  # 32 px / 8 px patches, CLS dropped
    common = ["--max-new-tokens", "5", "--ignore-eos", "--device", "cpu"]
    # no placeholder: the image goes first, as llama.cpp's multimodal CLI puts it
    assert main(["generate", str(d), "What is this?", "--image", str(a)] + common) == 0
    out = capsys.readouterr()
    ids = [1] + [img] * F + tok.encode("\nWhat is this?", add_special_tokens=False).ids
    assert f"{len(ids)} prompt tokens; 1 image; greedy" in out.err
    assert out.out == tok.decode(greedy_with_images(d, ids, [a], 5)) + "\n"
    # placeholders say where each image goes
    assert main(["generate", str(d), "A <image> and B <image>?", "--image", str(a),
                 "--image", str(b)] + common) == 0
    out = capsys.readouterr()
    ids = tok.encode("A ").ids + [img] * F + \
        tok.encode(" and B ", add_special_tokens=False).ids + [img] * F + \
        tok.encode("?", add_special_tokens=False).ids
    assert f"{len(ids)} prompt tokens; 2 images" in out.err
    assert out.out == tok.decode(greedy_with_images(d, ids, [a, b], 5)) + "\n"


def test_generate_with_images_from_ids_follows_the_placeholder_rule(llava, capsys):
    """--ids with --image: a lone image token is a placeholder (expanded to its span), ids
    without one get the span first (after BOS); expanded spans are taken as they are."""
    d, a, b = llava
    F, img = 16, 255
    common = ["--max-new-tokens", "3", "--ignore-eos", "--device", "cpu"]
    for given, want, pngs in (([1, 40, 41], [1] + [img] * F + [40, 41], [a]),
                              ([40, 41], [img] * F + [40, 41], [a]),
                              ([1, 40, img, 41, img], [1, 40] + [img] * F + [41] + [img] * F,
                               [a, b]),
                              ([1] + [img] * F + [9], [1] + [img] * F + [9], [a])):
        images = [x for p in pngs for x in ("--image", str(p))]
        assert main(["generate", str(d), "--ids", ",".join(map(str, given))] + images +
                    common) == 0
        out = capsys.readouterr()
        assert f"{len(want)} prompt tokens; {len(pngs)} image" in out.err, (given, out.err)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        assert out.out == tok.decode(greedy_with_images(d, want, pngs, 3)) + "\n"


def test_llava_without_images_and_mismatches(llava, capsys):
    d, a, _ = llava
    assert main(["generate", str(d), "Hello", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "metrale: no --image given: the LLaVA model runs text-only" in err
    assert "2 tokens" in err
    assert main(["generate", str(d), "A <image>", "--device", "cpu"]) == 1
    assert "1 <image> placeholder(s) but no --image" in err_line(capsys)
    assert main(["generate", str(d), "A <image>", "--image", str(a), "--image", str(a),
                 "--device", "cpu"]) == 1
    assert "1 <image> placeholder(s) but 2 --image file(s)" in err_line(capsys)
    assert main(["generate", str(d), "--ids", "1,255,7,255", "--image", str(a), "--device",
                 "cpu"]) == 1   # two placeholders in the ids, one image
    assert "2 image span(s) but 1 image(s)" in err_line(capsys)
    assert main(["generate", str(FIXTURES / "llama_gqa"), "--ids", "1", "--image",
                 str(a)]) == 1
    assert "--image needs a LLaVA" in err_line(capsys)
    assert main(["generate", str(d), "Hi", "--image", str(d / "nope.png")]) == 2
    assert "no such file" in err_line(capsys)


def test_chat_with_images(llava, capsys):
    """--chat puts the images in the user message: as <image> lines in a string content, or
    as image parts where the template takes a list of parts (LLaVA's templates, whose
    chat_template.json renders a string content as nothing)."""
    from tokenizers import Tokenizer
    d, a, _ = llava
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    common = ["--chat", "What is it?", "--image", str(a), "--max-new-tokens", "3",
              "--ignore-eos", "--device", "cpu"]
    from metrale.engine import apply_chat_template
    text = apply_chat_template(d, [{"role": "user", "content": "<image>\nWhat is it?"}],
                               tokenize=False)
    before, after = text.split("<image>")
    ids = tok.encode(before, add_special_tokens=False).ids + [255] * 16 + \
        tok.encode(after, add_special_tokens=False).ids
    assert main(["generate", str(d)] + common) == 0
    out = capsys.readouterr()
    assert f"{len(ids)} prompt tokens; 1 image" in out.err
    assert out.out == tok.decode(greedy_with_images(d, ids, [a], 3)) + "\n"
    # a template of content parts, in the processor's chat_template.json
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    parts = ("{% for m in messages %}{{ m['role'].upper() + ': ' }}{% for p in m['content'] | "
             "selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}{% for p in "
             "m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }} "
             "{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": parts}))
    ids = tok.encode("USER: ", add_special_tokens=False).ids + [255] * 16 + \
        tok.encode("\nWhat is it? ASSISTANT:", add_special_tokens=False).ids
    assert main(["generate", str(d)] + common) == 0
    out = capsys.readouterr()
    assert f"{len(ids)} prompt tokens; 1 image" in out.err
    assert out.out == tok.decode(greedy_with_images(d, ids, [a], 3)) + "\n"


# ------------------------------------------------------------------- Ctrl-C, at any time
INTERRUPT_AT_IMPORT = """
import sys

class Interrupt:   # a Ctrl-C landing while metrale.cli.generate is imported
    def find_spec(self, name, path=None, target=None):
        if name == "metrale.cli.generate":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
from metrale.cli import main
sys.exit(main(["generate", "preset:tiny", "--ids", "1,2"]))
"""


def test_ctrl_c_during_the_imports_is_one_line():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT], capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode, out.stderr.splitlines()) == (130, ["metrale: interrupted"]), \
        out.stderr


@pytest.mark.parametrize("when", [0.3, 1.0, "generating"])
def test_sigint_at_any_moment_of_a_run_is_one_line(when):
    """A real SIGINT to `python -m metrale generate` while it imports or loads (after 0.3 s,
    1 s) or once it streams tokens: exit status 130, one line on stderr, no traceback."""
    import signal
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-m", "metrale", "generate", "preset:tiny", "--ids",
                          "1,2", "--max-new-tokens", "100000", "--ignore-eos", "--device",
                          "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a shell's background job (CI's lanes) starts with SIGINT ignored,
                         # and Python keeps an ignored SIGINT: the child gets the terminal's
                         # default, as a user's run has
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if when == "generating":
        assert p.stdout.read(1)   # the first streamed token id
    else:
        time.sleep(when)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert p.returncode == 130 and len(lines) == 1 and \
        lines[0].startswith("metrale: interrupted"), (p.returncode, err)
    if when == "generating":
        assert re.fullmatch(r"metrale: interrupted after \d+ tokens", lines[0]), lines


# ------------------------------------------------------------------ text arguments, UTF-8
def test_a_prompt_that_is_not_utf8_is_one_line_with_its_byte_offset(tmp_path, capsys):
    """Bytes that do not decode reach Python as lone surrogates (surrogateescape), which
    `tokenizers` refuses with a TypeError traceback: refused first, naming the offset."""
    d = checkpoint(tmp_path)
    latin1 = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")   # Latin-1 'é'
    for argv, what in (([str(d), latin1], "PROMPT"), ([str(d), "--prompt", latin1], "--prompt"),
                       ([str(d), "--chat", "--system", latin1, "hi"], "--system")):
        assert main(["generate", *argv, "--device", "cpu"]) == 2
        line = err_line(capsys)
        assert f"{what} is not valid UTF-8 at byte offset 3 (bytes e9 20 61 75" in line, line
    assert main(["embed", str(d), "--text", latin1, "--device", "cpu"]) == 2
    assert "--text is not valid UTF-8 at byte offset 3" in err_line(capsys)
    assert main(["generate", str(d), "café", "--max-new-tokens", "1", "--device", "cpu"]) == 0
