"""CUDA-only engine tests: parity with the oracle, triton vs torch, eager vs graph, the gc capture guard."""

import gc

import pytest
import torch

from engine import Engine, SamplingParams
from tests.reference import ReferenceOuro
from tests.test_engine_parity import PROMPTS

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(path, prompts=PROMPTS, params=GREEDY, **options):
    with Engine(path, device="cuda", verbose=False, **options) as engine:
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("loops", [1, 2, 4])
def test_cuda_fp32_greedy_matches_reference(tiny_checkpoint, attention, loops):
    reference = ReferenceOuro(tiny_checkpoint, loops=loops)
    with Engine(tiny_checkpoint, device="cuda", dtype="float32", attention=attention, loops=loops,
                verbose=False) as engine:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        outputs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference.greedy(i, 16) for i in ids]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cuda_bf16_first_token_logits_within_tolerance(tiny_checkpoint, reference, attention):
    """bf16 keeps 8 mantissa bits: max |logit error| / max |logit| under 5% after 4 loops x 2 layers."""
    with Engine(tiny_checkpoint, device="cuda", dtype="bfloat16", attention=attention, enforce_eager=True,
                verbose=False) as engine:
        captured = {}
        compute = engine.model.compute_logits

        def spy(hidden):
            captured["logits"] = compute(hidden).float().cpu()
            return compute(hidden)

        engine.model.compute_logits = spy
        ids = engine.tokenizer.encode(PROMPTS[2])
        engine.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    expected = reference.next_logits(ids)
    error = (captured["logits"][0] - expected).abs().max() / expected.abs().max()
    assert error < 0.05


def test_triton_equals_torch_fp32_and_bf16_agrees_mostly(tiny_checkpoint):
    assert _tokens(tiny_checkpoint, dtype="float32", attention="triton") == \
        _tokens(tiny_checkpoint, dtype="float32", attention="torch")
    a = _tokens(tiny_checkpoint, dtype="bfloat16", attention="triton", enforce_eager=True)
    b = _tokens(tiny_checkpoint, dtype="bfloat16", attention="torch")
    first = [x[0] for x in a] == [y[0] for y in b]
    assert first  # stated tolerance: the first greedy token of every prompt agrees in bf16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_graph_decode_is_bitwise_equal_to_eager_decode(tiny_checkpoint, dtype, rows):
    """Same decode batch through the captured graph and eagerly: identical hidden states and gates.
    rows=5 is padded to the 8-row bucket in the graph (cuBLAS then sees another M), so only bucket-sized
    batches are promised bitwise; 5 checks that padding rows never leak into real rows' tokens."""
    with Engine(tiny_checkpoint, device="cuda", dtype=dtype, attention="triton", max_num_seqs=16,
                verbose=False) as engine:
        prompts = [[7 + i] * (5 + 3 * i) for i in range(rows)]
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # prefill all rows
        batch = engine.scheduler.schedule()
        assert all(n == 1 for n in batch.num_new_tokens) and len(batch.requests) == rows
        runner = engine.runner
        input_ids, positions, meta, readout = runner.prepare(batch)
        with torch.inference_mode():
            graph = runner.graphs.replay(input_ids, positions, meta)
            graph = (graph.hidden.clone(), graph.gate_logits.clone())
            engine.backend.prepare(meta)
            eager = engine.model(input_ids, positions, engine.backend.forward,
                                 torch.tensor(readout, device="cuda"))
        if rows in runner.graphs.buckets:
            assert torch.equal(graph[0], eager.hidden) and torch.equal(graph[1], eager.gate_logits)
        logits_graph = engine.model.compute_logits(graph[0][-1]).argmax(-1)
        logits_eager = engine.model.compute_logits(eager.hidden[-1]).argmax(-1)
        assert torch.equal(logits_graph, logits_eager)


def test_graph_and_eager_engines_give_identical_tokens(tiny_checkpoint):
    prompts = PROMPTS * 2  # 8 rows: a bucket
    assert _tokens(tiny_checkpoint, prompts, dtype="bfloat16", attention="triton") == \
        _tokens(tiny_checkpoint, prompts, dtype="bfloat16", attention="triton", enforce_eager=True)


def _leave_cyclic_cuda_garbage():
    """An earlier engine's leftovers: a captured graph, its pool's tensors and a stream, in a cycle."""
    stream = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = x * 2
    node = {"graph": graph, "stream": stream, "tensors": [x, y]}
    node["self"] = node  # only the cycle collector can free it


def test_capture_survives_cyclic_cuda_garbage_thanks_to_gc_collect(tiny_checkpoint):
    from model.cuda_graph import DecodeGraphs

    thresholds = gc.get_threshold()
    try:
        with Engine(tiny_checkpoint, device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=2,
                    verbose=False) as engine:
            runner = engine.runner
            args = (engine.model, engine.backend, 2, 8, engine.kv_pool.block_size, engine.kv_pool.num_blocks - 1,
                    engine.device)
            gc.collect()
            gc.set_threshold(1, 1, 1)  # a collection is due at almost every allocation: it will run mid-capture
            _leave_cyclic_cuda_garbage()
            with pytest.raises(RuntimeError):
                DecodeGraphs(*args).capture_all(collect=lambda: None)  # without the guard: the capture aborts
            torch.cuda.synchronize()
            gc.set_threshold(*thresholds)
            gc.collect()
            gc.set_threshold(1, 1, 1)
            _leave_cyclic_cuda_garbage()
            graphs = DecodeGraphs(*args)
            graphs.capture_all()  # with gc.collect() first: the garbage is gone before capture
            assert set(graphs.graphs) == {1, 2}
            del runner
    finally:
        gc.set_threshold(*thresholds)
