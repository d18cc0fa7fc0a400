"""The bench's case tables, without a GPU: every case of a suite has its own label, the
label names what the case measures, and the FLOP count follows FlashAttention's convention."""
import pytest

from cuattn.bench import SUITES, Case


@pytest.mark.parametrize("suite", list(SUITES))
def test_case_labels_are_unique_within_a_suite(suite):
    labels = [c.label for c in SUITES[suite]]
    assert len(labels) == len(set(labels)), suite


def test_masked_suite_names_its_mask_or_bias_and_direction():
    cases = SUITES["masked"]
    assert {c.side for c in cases} == {"mask", "bias"}
    assert {c.direction for c in cases} == {"fwd", "bwd"}
    for c in cases:
        assert c.side in c.label.split()
        assert ("bwd" in c.label.split()) == (c.direction == "bwd")


def test_flops_count_the_causal_half_and_the_backward_factor():
    fwd = Case("x", "attention", "bfloat16", 2, 3, 128, 64)
    assert fwd.flops == 4.0 * 2 * 3 * 128 * 128 * 64
    assert Case("x", "attention", "bfloat16", 2, 3, 128, 64, causal=True).flops == fwd.flops / 2
    assert Case("x", "attention", "bfloat16", 2, 3, 128, 64, direction="bwd",
                side="mask").flops == 2.5 * fwd.flops


def test_timed_rows_time_each_implementation_and_keep_going(monkeypatch):
    """A row per implementation with its rate; one that raises becomes a note; PyTorch's
    TF32 switch is set for the float32 rows and restored."""
    import types

    from cuattn import _bench_core as bench
    monkeypatch.setattr(bench, "_time", lambda fn, cupy: fn())
    monkeypatch.setattr(bench, "_peak_extra_mb", lambda fn, cupy, torch: 1.5)
    freed = []
    cupy = types.SimpleNamespace(get_default_memory_pool=lambda: types.SimpleNamespace(
        free_all_blocks=lambda: freed.append(1)))
    matmul = types.SimpleNamespace(allow_tf32=True)
    seen = []
    torch = types.SimpleNamespace(backends=types.SimpleNamespace(
        cuda=types.SimpleNamespace(matmul=matmul)), cuda=types.SimpleNamespace(
        empty_cache=lambda: None))

    def fails():
        raise RuntimeError("no kernel\nfor this")

    case = bench.Case("fp32", "attention", "float32", 1, 1, 1000, 100)
    rows = bench._timed_rows({"cuattn": lambda: seen.append(matmul.allow_tf32) or 2.0,
                              "torch math": fails}, case, cupy, torch, tf32=False)
    assert [r.impl for r in rows] == ["cuattn", "torch math"]
    assert rows[0].ms == 2.0 and rows[0].rate == case.flops / 2.0 / 1e9
    assert rows[0].extra_mb == 1.5 and seen == [False]
    assert rows[1].ms is None and rows[1].note == "RuntimeError: no kernel"
    assert matmul.allow_tf32 is True and len(freed) == 2


def test_decode_cases_count_kv_bytes():
    from cuattn.bench import SUITES
    case = SUITES["decode"][3]  # B1 Hq32 Hk8 Sq1 Sk131072: each K/V head read once
    assert case.label == "B1 Hq32 Hk8 Sq1 Sk131072 D128 bfloat16"
    assert case.kv_bytes == 2 * 8 * 131072 * 128 * 2
    assert case.rate(2.0) == case.kv_bytes / 2.0 / 1e6  # GB/s at 2 ms
    assert SUITES["decode"][0].label == "B1 H32 Sq1 Sk32768 D128 bfloat16"


def test_key_length_cases_count_the_keys_of_their_lengths():
    from cuattn.bench import SUITES
    case = SUITES["lengths"][0]  # B16 Hq32 Hk8 Sq1, half of 16384 keys per entry
    assert case.label == "B16 Hq32 Hk8 Sq1 Sk16384 D128 bfloat16 lengths 8192"
    assert case.kv_bytes == 2 * 16 * 8 * 8192 * 128 * 2


def test_readme_block_is_rewritten_between_its_markers(tmp_path):
    """--readme rewrites only the lines between the README's markers: per suite its first
    forward and first backward case, cuattn's rate and the flash and cuDNN ratios (peer
    time / cuattn time), under the run's GPU, driver, date and command; a README without
    both markers is refused and left as it was."""
    from cuattn._bench_core import Result, Row
    from cuattn._bench_report import README_BEGIN, README_END, write_readme
    env = {"gpu": "NVIDIA H200", "driver": 13000, "date": "2026-12-07 10:00:00",
           "command": "python -m cuattn bench --suite train --readme README.md"}
    fwd = Case("train", "attention", "bfloat16", 2, 16, 4096, 128)
    bwd = Case("train", "attention", "bfloat16", 2, 16, 4096, 128, direction="bwd")
    later = Case("train", "attention", "bfloat16", 2, 16, 8192, 128)
    results = [Result(fwd, [Row("cuattn", 2.0, 500.0), Row("torch flash", 3.0, 333.3),
                            Row("torch cudnn", 1.0, 1000.0)]),
               Result(bwd, [Row("cuattn", 4.0, 400.0), Row("torch flash", None)]),
               Result(later, [Row("cuattn", 2.0, 600.0)])]
    path = tmp_path / "README.md"
    path.write_text(f"# x\n\nbefore\n{README_BEGIN}\nold table\n{README_END}\nafter\n")
    write_readme(results, path, env)
    text = path.read_text()
    assert text.startswith(f"# x\n\nbefore\n{README_BEGIN}\nNVIDIA H200, driver 13000, "
                           f"2026-12-07;") and text.endswith(f"\n{README_END}\nafter\n")
    assert "old table" not in text and env["command"] in text
    table = [line for line in text.splitlines() if line.startswith("| train")]
    assert table == [f"| train | {fwd.label} | 500.0 TFLOP/s | 1.50x | 0.50x |",
                     f"| train | {bwd.label} | 400.0 TFLOP/s | - | - |"]
    path.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no block"):
        write_readme(results, path, env)
    assert path.read_text() == "# no markers\n"
