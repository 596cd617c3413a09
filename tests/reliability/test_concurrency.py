"""Guarantee: a model is driven by one thread at a time (a second thread gets ConcurrentUse,
tests/model/test_lifecycle.py); two models in one process, each with its own stream and
thread, work independently and give the results they give alone."""
import threading

from metrale.engine import generate
from metrale.gpu_runtime import HostBackend
from tests.model.common import golden, load


def test_two_models_on_two_threads_match_their_solo_runs():
    p1 = golden("llama_gqa")["input_ids"][0, :8].tolist()
    p2 = golden("qwen2")["input_ids"][0, :5].tolist()
    a, b = load("llama_gqa"), load("qwen2")
    want_a = generate(a, p1, 10, stop_token_ids=[]).tokens
    want_b = generate(b, p2, 10, stop_token_ids=[]).tokens
    results, errors = {}, []

    def drive(name, model, prompt):
        try:
            for i in range(5):
                results[(name, i)] = generate(model, prompt, 10, stop_token_ids=[]).tokens
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=drive, args=("a", a, p1)),
               threading.Thread(target=drive, args=("b", b, p2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(results[("a", i)] == want_a and results[("b", i)] == want_b for i in range(5))


def test_two_models_share_a_backend_interleaved():
    be = HostBackend()
    a, b = load("mistral", be), load("qwen3", be)
    p = golden("mistral")["input_ids"][0, :6].tolist()
    want_a, want_b = (generate(m, p, 6, stop_token_ids=[]).tokens for m in (a, b))
    sa, sb = a.alloc_sequence(), b.alloc_sequence()
    ta = a.argmax_on_device(a.prefill(p, sa, a.default_stream()), a.default_stream())
    tb = b.argmax_on_device(b.prefill(p, sb, b.default_stream()), b.default_stream())
    out_a, out_b = [ta], [tb]
    for _ in range(5):
        out_a.append(a.argmax_on_device(a.decode(out_a[-1], sa, 0), 0))
        out_b.append(b.argmax_on_device(b.decode(out_b[-1], sb, 0), 0))
    assert out_a == want_a and out_b == want_b
    a.teardown()
    b.teardown()
    assert be.live_bytes() == 0
