"""Engine(deterministic=True) on CUDA (Triton backend, bf16), at Ouro-1.4B's shapes with random weights (4 of
its 24 layers: every shape a step runs, at a fraction of the set-up): a request's logprobs are the same bits
(a) alone and in a batch, (b) eager and under CUDA graphs (decode buckets with padding rows, piecewise graphs
for prompt steps), (c) with chunked prefill, (d) on a prefix-cache hit, (e) preempted and recomputed, (f)
with async scheduling and without, (g) as a self-speculative verify row, (h) after other batches; and the GEMM
kernels give a row the same bits at every row count. tests/test_deterministic.py covers the CPU."""

import os
import random

import pytest
import torch

from engine import Engine, SamplingParams
from exit_policy import force_exit_loop

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)
SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048), "gate": (1, 2048)}


def _prompts(n: int, seed: int, low: int = 4, high: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randint(low, high))] for _ in range(n)]


PROMPTS = _prompts(12, seed=1)


@pytest.fixture(scope="module")
def ouro_shape(tmp_path_factory):
    from model.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ouro-4-layers"), "ouro-1.4b", layers=4)


def _bits(output) -> tuple:
    completion = output.outputs[0]
    assert len(completion.token_ids) == PARAMS.max_tokens, completion.finish_reason
    logprobs = tuple(tuple(sorted((t, e.logprob) for t, e in step.items())) for step in completion.logprobs)
    return tuple(completion.token_ids), logprobs


def _engine(path, **options) -> Engine:
    options = {"max_num_seqs": 16, "max_model_len": 1024, "gpu_memory_utilization": 0.4,
               "piecewise_graph_tokens": 128, "deterministic": True, **options}
    return Engine(path, device="cuda", dtype="bfloat16", verbose=False, **options)


def _run(path, prompts=PROMPTS, **options) -> list[tuple]:
    with _engine(path, **options) as engine:
        return [_bits(out) for out in engine.generate(prompts, PARAMS, use_tqdm=False)]


SHARED = _prompts(1, seed=5, low=160, high=160)[0]
PREFIXED = [SHARED + [11, 12, 13], SHARED + [21]]


@pytest.fixture(scope="module")
def batch(ouro_shape):
    """One engine with the CUDA defaults (graphs, piecewise graphs for short prompt steps, async scheduling,
    prefix caching): the prompts in one batch; then the first four each alone ((a), (h)); then two prompts
    that share 160 tokens, the second hitting the first's blocks ((d))."""
    with _engine(ouro_shape) as engine:
        assert engine.uses_cuda_graphs
        together = [_bits(out) for out in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]
        alone = [_bits(engine.generate([p], PARAMS, use_tqdm=False)[0]) for p in PROMPTS[:4]]
        engine.generate(PREFIXED[:1], PARAMS, use_tqdm=False)
        hit = engine.generate(PREFIXED[1:], PARAMS, use_tqdm=False)[0]
        assert hit.num_cached_tokens == 160
    return together, alone, _bits(hit)


@pytest.fixture(scope="module")
def eager_chunked_sync(ouro_shape):
    """Another engine: no graphs of any kind, prompt steps of at most 40 tokens, synchronous steps, no prefix
    cache ((b), (c), (f), and the miss of (d))."""
    with _engine(ouro_shape, enforce_eager=True, max_num_batched_tokens=40, async_scheduling=False,
                 enable_prefix_caching=False) as engine:
        assert not engine.uses_cuda_graphs
        outputs = [_bits(out) for out in engine.generate(PROMPTS, PARAMS, use_tqdm=False)]
        miss = _bits(engine.generate(PREFIXED[1:], PARAMS, use_tqdm=False)[0])
    return outputs, miss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", SHAPES)
def test_invariant_gemm_gives_a_row_the_same_bits_at_every_row_count(name, dtype):
    """Up to 64 rows the skinny kernel, past them the tiled one (past 256 rows with K blocks of half the
    config's): a row's bits at every row count."""
    from model.kernels import gemv

    n, k = SHAPES[name]
    torch.manual_seed(0)
    weight = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    x = torch.randn(700, k, device="cuda").to(dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = gemv.invariant_config(n, k, dtype, sms)
    alone = torch.cat([gemv.invariant_linear(x[i:i + 1], weight, config) for i in (0, 5, 16, 63, 64, 200)])
    for m in (1, 3, 16, 17, 33, 64, 65, 128, 700):
        y = gemv.invariant_linear(x[:m], weight, config)
        rows = [i for i in (0, 5, 16, 63, 64, 200) if i < m]
        assert torch.equal(y[rows], alone[:len(rows)]), (name, m)


def test_epilogue_kernels_give_the_unfused_bits_under_invariant_configs():
    """At 1 to 16 rows a layer's qkv and gate_up projections run RoPE and SiLU-mul in their GEMM epilogue;
    past 16 rows, the unfused composition. Deterministic mode needs both to give a row the same bits (its o
    and down projections take the norm kernel at every row count)."""
    from model.kernels import fused, gemv, gemv_epilogues
    from model.ouro import Rotary

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wq, wg = ((torch.randn(n, 2048, device="cuda") * 0.02).bfloat16() for n in (6144, 11264))
    cq, cg = (gemv.invariant_config(w.shape[0], 2048, torch.bfloat16, sms) for w in (wq, wg))
    x = torch.randn(16, 2048, device="cuda").bfloat16()
    cos, sin = Rotary(128, 10000.0).cuda()(torch.arange(16, device="cuda") + 300, torch.bfloat16)
    for m in (1, 4, 16):
        fused_qkv = gemv_epilogues.qkv_rope(x[:m], wq, cos[:m], sin[:m], 16, 16, 128, config=cq)
        plain_qkv = fused.rope_qkv(gemv.invariant_linear(x[:m], wq, cq), cos[:m], sin[:m], 16, 16, 128)
        assert all(torch.equal(a, b) for a, b in zip(fused_qkv, plain_qkv)), m
        assert torch.equal(gemv_epilogues.gate_up_silu(x[:m], wg, config=cg),
                           fused.silu_mul(gemv.invariant_linear(x[:m], wg, cg))), m


def test_a_request_alone_has_its_batch_bits_and_h_earlier_batches_change_none(batch):
    together, alone, _ = batch
    assert alone == together[:4]


def test_b_c_f_eager_chunked_synchronous_steps_have_the_graph_bits(batch, eager_chunked_sync):
    """Graphs (decode buckets with padding rows, piecewise prompt graphs padded to a token bucket), whole
    prompts and async scheduling against eager steps, 40-token chunks and synchronous scheduling."""
    assert eager_chunked_sync[0] == batch[0]


def test_d_prefix_cache_hit_has_the_bits_of_a_miss(batch, eager_chunked_sync):
    assert batch[2] == eager_chunked_sync[1]


def test_e_preempted_requests_keep_their_bits(ouro_shape, batch):
    # 22 blocks of 16 and prompt chunks of 256: the 12 prompts preempt one another (4 times on the CPU)
    with _engine(ouro_shape, num_kv_blocks=22, admission="greedy", max_model_len=320,
                 max_num_batched_tokens=256) as engine:
        outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0
    assert [_bits(out) for out in outputs] == batch[0]


def test_g_self_speculative_verify_rows_have_the_plain_decode_bits(ouro_shape, batch):
    assert _run(ouro_shape, speculative="loops:2", num_speculative_tokens=3) == batch[0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_h_forced_exits_hold_for_a_batch_of_32_after_a_batch_of_1(ouro_shape, deterministic):
    """benchmarks/early_exit.py's order: an engine that ran a batch of one first still exits every token of a
    batch of 32 where the forced gate says (after loop 0: one loop a token), in either mode."""
    from benchmarks.early_exit import decode_run

    with _engine(ouro_shape, exit_policy="early:0.5", max_num_seqs=32, max_model_len=600,
                 enable_prefix_caching=False, deterministic=deterministic) as engine:
        force_exit_loop(engine.model, 0, 0.5)
        assert decode_run(engine, 1, 512, 8, seed=1)["loops_per_token"] == 1.0
        assert decode_run(engine, 32, 512, 8, seed=32)["loops_per_token"] == 1.0


def test_fp32_requests_keep_their_bits_alone_and_eager(tiny_checkpoint):
    """fp32 on CUDA: the tensor-core configs multiply in full fp32 (no TF32)."""
    params = PARAMS
    prompts = [[t % 500 for t in p] for p in _prompts(6, seed=2, high=60)]
    options = dict(device="cuda", dtype="float32", deterministic=True, verbose=False, max_num_seqs=8)
    with Engine(tiny_checkpoint, **options) as engine:
        together = [_bits(o) for o in engine.generate(prompts, params, use_tqdm=False)]
        alone = [_bits(engine.generate([p], params, use_tqdm=False)[0]) for p in prompts[:2]]
    with Engine(tiny_checkpoint, enforce_eager=True, **options) as engine:
        eager = [_bits(o) for o in engine.generate(prompts, params, use_tqdm=False)]
    assert alone == together[:2] and eager == together


def test_engines_one_after_another_under_host_load_keep_their_bits(ouro_shape, batch):
    """Engines built one after another in one process, while other processes keep every CPU core busy, give
    the first engine's bits: a probe once saw engines late in such a sequence, under host load, give other
    tokens (one of them token 0 from its second token on), in the mode and out of it."""
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(os.cpu_count() or 1)]
    try:
        configs = [("chunks of 40", dict(max_num_batched_tokens=40)), ("eager", dict(enforce_eager=True)),
                   ("synchronous", dict(async_scheduling=False)), ("defaults", {}),
                   ("eager again", dict(enforce_eager=True))]
        runs = {name: _run(ouro_shape, **options) for name, options in configs}
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert {name: bits == batch[0] for name, bits in runs.items()} == {name: True for name in runs}
    assert split_k_tickets_left() == 0


def split_k_tickets_left() -> int:
    """The skinny GEMM's split-K tickets not back at zero on this device (model/kernels/gemv.py): each launch
    puts its tickets back, so any left over mean two launches overlapped and every later split-K sum of the
    process is wrong (graph captures' warm-ups once ran beside the replay of the graph captured before)."""
    from model.kernels.gemv import _workspace

    tickets = _workspace(torch.device("cuda", torch.cuda.current_device())).tickets
    return 0 if tickets is None else int((tickets != 0).sum())


def test_a_side_stream_warm_up_runs_after_the_current_streams_work():
    """What a capture's warm-up (runner/cuda_graph.py: side_stream_after_current) reads on its side stream
    is what the current stream wrote before, even while that stream is still busy."""
    from runner.cuda_graph import side_stream_after_current

    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on the current stream
    x.fill_(1.0)
    with side_stream_after_current(torch.cuda.Stream()):
        seen = x.sum()
    torch.cuda.synchronize()
    assert seen.item() == x.numel()
