"""What deterministic mode relies on of torch's CPU ops (docs/deterministic.md): model/batch_invariant.py's
row-by-row products and attention/tiled_reference.py's key tiles give a row the same bits whatever the other
rows hold, however many there are and whatever the thread count; the elementwise ops they use round alike
wherever an element sits; the sampler's row-wise log_softmax is per row."""

import pytest
import torch

from attention.tiled_reference import KEY_TILE, tiled_attention
from model import batch_invariant


@pytest.fixture
def two_thread_counts():
    """Runs the test body's checks at 1 and 2 threads: yields a function that sets the count."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("k,n", [(256, 768), (2048, 6144), (5632, 2048), (2048, 1)])
def test_linear_gives_a_row_its_bits_at_any_row_count_and_thread_count(k, n, two_thread_counts):
    torch.manual_seed(0)
    weight, x = torch.randn(n, k), torch.randn(70, k)
    results = []
    for threads in (1, 2):
        two_thread_counts(threads)
        alone = batch_invariant.linear(x[5:6], weight)
        for m in (6, 9, 17, 70):
            others = x[:m].clone()
            others[:5] = torch.randn(5, k)
            assert torch.equal(batch_invariant.linear(others, weight)[5:6], alone), (threads, m)
        results.append(alone)
    assert torch.equal(results[0], results[1])


def test_rms_norm_gives_a_row_its_bits_at_any_row_count():
    torch.manual_seed(0)
    x, weight = torch.randn(40, 2048), 1 + 0.1 * torch.randn(2048)
    alone = batch_invariant.rms_norm(x[3:4], weight, 1e-6)
    for m in (4, 16, 40):
        assert torch.equal(batch_invariant.rms_norm(x[:m], weight, 1e-6)[3:4], alone)


@pytest.mark.parametrize("op", [torch.exp, torch.cos, torch.sin, torch.sqrt, torch.reciprocal,
                                batch_invariant.silu])
def test_elementwise_ops_round_alike_wherever_an_element_sits(op):
    """A vectorized loop and its scalar tail would round silu, sigmoid or rsqrt differently; these do not."""
    torch.manual_seed(0)
    values = torch.randn(1 << 16).abs() * 4 + 0.01
    whole = op(values)
    for length in (1, 7, 15, 17, 33, 100, 5000):
        for offset in (0, 1, 5, 13, 16, 29):
            assert torch.equal(op(values[offset:offset + length].clone()), whole[offset:offset + length])


def test_tiled_attention_gives_a_query_its_bits_in_any_chunk_and_alone():
    torch.manual_seed(0)
    length = 2 * KEY_TILE + 22
    q, k, v = torch.randn(length, 8, 32), torch.randn(length, 4, 32), torch.randn(length, 4, 32)
    whole = tiled_attention(q, k, v, 0.17)
    for start, end in [(0, 40), (40, 80), (63, 129), (80, length)]:
        assert torch.equal(tiled_attention(q[start:end], k[:end], v[:end], 0.17), whole[start:end])
    for position in (0, KEY_TILE - 1, KEY_TILE, length - 1):
        alone = tiled_attention(q[position:position + 1], k[:position + 1], v[:position + 1], 0.17)
        assert torch.equal(alone, whole[position:position + 1])


def test_log_softmax_is_per_row():
    torch.manual_seed(0)
    logits = torch.randn(64, 49152)
    alone = torch.log_softmax(logits[9:10], -1)
    for m in (10, 33, 64):
        assert torch.equal(torch.log_softmax(logits[:m], -1)[9:10], alone)
