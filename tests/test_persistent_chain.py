"""benchmarks/persistent_chain.py's chain kernel under the interpreter: one persistent launch (one program, so
its grid barrier never waits on a program the interpreter has not run yet) and one launch a product (several
programs) give the same bits, and both match torch's chain."""

import pytest
import torch

from benchmarks.persistent_chain import Chain, check_shapes, launch_per_phase, launch_persistent, torch_chain

pytestmark = pytest.mark.interpreter

SHAPES = [(32, 16), (16, 32), (48, 16), (16, 48)]  # (N, K): each K at most the N before it


def _chain() -> Chain:
    torch.manual_seed(0)
    offsets, numel = [], 0
    for n, k in SHAPES:
        offsets.append(numel)
        numel += n * k
    weights = torch.randn(numel) * 0.25
    return Chain(SHAPES, weights, offsets)


def test_persistent_and_per_phase_agree_bit_for_bit_and_with_torch():
    chain, x = _chain(), torch.randn(SHAPES[0][1])
    check_shapes(chain, block_n=8, block_k=16)
    chain.start(x)
    launch_persistent(chain, programs=1, block_n=8, block_k=16, stages=1, prefetch_k=0)
    persistent = chain.output()
    assert chain.counter.item() == len(SHAPES) - 1  # one arrival a barrier
    chain.start(x)
    launch_per_phase(chain, programs=3, block_n=8, block_k=16, stages=1, prefetch_k=0, pdl=False)
    assert torch.equal(chain.output(), persistent)
    torch.testing.assert_close(persistent, torch_chain(chain, x, len(SHAPES)), rtol=1e-5, atol=1e-5)


def test_a_product_the_tiles_do_not_divide_is_named():
    with pytest.raises(ValueError, match="product 1 is 16 x 32: N must be a multiple of block_n=32"):
        check_shapes(_chain(), block_n=32, block_k=16)
