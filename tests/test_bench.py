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
