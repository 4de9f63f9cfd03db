"""Chained loop passes (Engine(depth_batching=True, passes_per_step=P), runner/pass_chains.py): a
depth-batched decode step runs P passes on the device and the host reads them once. A request's tokens equal
lockstep's under full depth, early:Q, an exit criterion and per-request loops, over the full and latest
layouts, with chunked prefill and staggered arrivals, whatever P; a step appends several tokens a row; a stop
inside a chain drops the tokens after it; a batch with a row that cannot chain runs one pass; the option is
checked by name. CPU, fp32, the torch backend."""

import pytest
import torch

from engine import Engine, SamplingParams
from tests.test_depth_batching import PROMPTS, run

NEW_TOKENS = 9


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **overrides})


def chained(checkpoint, prompts, params, passes: int, static: bool = False, **engine_args):
    """run() with depth batching and `passes` a step, counting the steps that chained passes and the tokens
    their rows appended. static: every chained pass through the chain graphs' static buffers, uncaptured
    (runner/chain_graphs.py: the body a CUDA capture records)."""
    steps, appended = [], []
    engine_args = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 6, "verbose": False,
                   **engine_args}
    with Engine(checkpoint, depth_batching=True, passes_per_step=passes, **engine_args) as engine:
        runner = engine.runner
        chain = runner._chained_passes
        if static:
            counts = static_chain_graphs(runner)

        def counted(batch):
            result = chain(batch)
            steps.append(batch.num_seqs)
            appended.extend(len(tokens or []) for tokens in result.tokens)
            return result

        runner._chained_passes = counted
        outputs = [out.outputs[0] for out in engine.generate(prompts, params, use_tqdm=False)]
        stats = engine.loop_stats
        if static:  # every chain ran through the graphs' buffers, one body a pass
            assert counts["runs"] == len(steps) and counts["bodies"] == counts["passes"] >= len(steps)
        assert not runner.mid_tokens
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return outputs, stats, steps, appended


def static_chain_graphs(runner) -> dict[str, int]:
    """The runner's chains, plain or pipelined speculation's, through uncaptured chain graphs
    (runner/chain_graphs.py: the body a CUDA capture records, run eagerly; its one-pass steps through the pass
    graphs' buffers, which they share); counts of the chains run (those that went on from the buffers, a
    pipelined chain's `resume`, among them), the passes they asked and the bodies run."""
    runner.depth.graphs = runner.pass_graphs()
    graphs, = runner.chain_graphs()
    counts = {"runs": 0, "resumed": 0, "passes": 0, "bodies": 0}
    body = graphs.body

    def counted(run, resumed: int):
        def counted_run(*args):  # the passes come last
            counts["runs"] += 1
            counts["resumed"] += resumed
            counts["passes"] += args[-1]
            return run(*args)
        return counted_run

    def counted_body(bs, eager):
        counts["bodies"] += 1
        return body(bs, eager)

    graphs.run, graphs.body = counted(graphs.run, 0), counted_body
    if hasattr(graphs, "resume"):
        graphs.resume = counted(graphs.resume, 1)
    return counts


def shadowed_fused_steps(runner) -> list[int]:
    """The chain graphs' body (plain chains' or pipelined speculation's) run twice a pass from the same
    buffers: the tensor operations' step, then the fused step (runner/chain_step_kernels.py, in the
    interpreter), which goes on. Every buffer the step writes must hold the same bits, and the next pass's
    lengths and slot offsets (which the tensor step leaves to the next layer call) those of the rows'
    positions and loops. Returns the row count of each pass."""
    counts = static_chain_graphs(runner)
    chains = runner.speculative_chains or runner.chains
    graphs, passes = chains.graphs, chains.graphs.graphs
    written = {"state": passes.state, "positions": passes.positions, "slot": passes.slot_mapping,
               "hidden": graphs.hidden, "gates": graphs.gates, "loop": graphs.loop, "active": graphs.active,
               "finished": graphs.finished, "record": graphs.record, "count": graphs.count}
    if runner.speculative_chains is not None:
        written.update(given=graphs.given, served=graphs.served)
    elif graphs.rule is not None:
        written.update({f"rule {i}": buffer for i, buffer in enumerate(graphs.rule.buffers)})
    offset_of = runner.chains.offset_of
    body, seen = graphs.body, []

    def shadowed(bs, eager):
        before = {name: buffer.clone() for name, buffer in written.items()}
        graphs.fused = False
        body(bs, eager)
        expected = {name: buffer.clone() for name, buffer in written.items()}
        for name, buffer in written.items():
            buffer.copy_(before[name])
        graphs.fused = True
        body(bs, eager)
        for name, buffer in written.items():
            assert torch.equal(buffer.isnan(), expected[name].isnan()), name
            assert torch.equal(buffer.nan_to_num(7.0), expected[name].nan_to_num(7.0)), name
        assert torch.equal(passes.context_lens[:bs].long(), passes.positions[:bs] + 1)
        assert torch.equal(passes.slot_offsets[:bs], offset_of[graphs.loop[:bs]])
        seen.append(bs)

    graphs.body = shadowed
    assert counts["bodies"] == 0
    return seen


def skinny_head(engine, honour_skip: bool) -> list[bool]:
    """The runner's chains through uncaptured chain graphs with the fused step (in the interpreter).
    honour_skip: the model's head through the skinny GEMM kernel (as on CUDA) with the fused step's skip
    flag, its output poisoned with NaN first, so that a head skipped where a row needed it gives that row
    token 0; else every head computed (torch's linear, the interpreter's time spared). Returns each fused
    head's flag, as the step computed it."""
    from model.kernels.gemv import skinny_linear

    static_chain_graphs(engine.runner)
    (engine.runner.speculative_chains or engine.runner.chains).graphs.fused = True
    weight, flags = engine.model.lm_head.weight, []

    def head(h: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            flags.append(bool(skip.item()))
        if not honour_skip:
            return torch.nn.functional.linear(h, weight)
        out = torch.full((*h.shape[:-1], weight.shape[0]), float("nan"), dtype=h.dtype)
        return skinny_linear(h.contiguous(), weight, out=out, skip=skip)

    engine.model.compute_logits = head
    return flags


@pytest.mark.interpreter
def test_a_pass_where_no_row_finishes_skips_the_head_and_changes_no_token(tiny_checkpoint):
    """A fused pass in which no row's token finishes reads no head weights (compute_logits' skip): under
    early:0.5's mixed exits the tokens are those of the same run with every head computed, and some passes
    did skip, some did not."""
    tokens, flags = [], []
    for honour in (False, True):
        with Engine(tiny_checkpoint, device="cpu", dtype="float32", max_num_batched_tokens=64, verbose=False,
                    depth_batching=True, passes_per_step=6, loops=4, exit_policy="early:0.5") as engine:
            flags.append(skinny_head(engine, honour))
            outputs = engine.generate(PROMPTS[:2], greedy(max_tokens=5), use_tqdm=False)
            tokens.append([out.outputs[0].token_ids for out in outputs])
    assert tokens[0] == tokens[1] and flags[0] == flags[1]
    assert any(flags[1]) and not all(flags[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["full", "early:0.5", "latent-diff:0.9"])
def test_fused_step_between_passes_writes_the_tensor_steps_bits(tiny_checkpoint, policy):
    """The fused step (one kernel a pass on CUDA, around the exit rule) against the tensor operations it
    replaces, pass by pass, on every buffer, the exit rule's memory included; the tokens stay lockstep's."""
    params = greedy()
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=4, exit_policy=policy)
    engine_args = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 6, "verbose": False}
    with Engine(tiny_checkpoint, depth_batching=True, passes_per_step=5, loops=4, exit_policy=policy,
                **engine_args) as engine:
        seen = shadowed_fused_steps(engine.runner)
        outputs = [out.outputs[0] for out in engine.generate(PROMPTS, params, use_tqdm=False)]
        assert not engine.runner.mid_tokens
    assert len(seen) > 0
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]


@pytest.mark.parametrize("passes", [2, 5, 8])
@pytest.mark.parametrize("policy", ["full", "early:0.5", "latent-diff:0.9"])
def test_chains_give_the_lockstep_tokens_and_loops(tiny_checkpoint, policy, passes):
    params = greedy()
    lockstep, lockstep_stats = run(tiny_checkpoint, PROMPTS, params, False, loops=4, exit_policy=policy)
    outputs, stats, steps, appended = chained(tiny_checkpoint, PROMPTS, params, passes, loops=4,
                                              exit_policy=policy)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert stats.decode_tokens == lockstep_stats.decode_tokens
    assert stats.decode_loops == lockstep_stats.decode_loops  # rows idle past their reservation uncounted
    assert steps and (passes < 5 or max(appended) > 1)  # past the loops a step appends several tokens a row
    for completion in outputs:  # a chain's rows run every pass: a token spans one pass per loop it runs
        assert completion.depth.tokens == NEW_TOKENS - 1 and completion.depth.passes == completion.depth.loops


@pytest.mark.parametrize("prompts", [PROMPTS[:3], PROMPTS], ids=["3 rows", "4 rows"])
@pytest.mark.parametrize("policy", ["full", "early:0.5", "latent-diff:0.9"])
def test_chain_graphs_body_gives_the_lockstep_tokens_and_loops(tiny_checkpoint, policy, prompts):
    """Each chained pass through the chain graphs' static buffers (runner/chain_graphs.py), uncaptured: the
    pass and the step to the next over a bucket, 3 rows padded to 4."""
    params = greedy()
    lockstep, lockstep_stats = run(tiny_checkpoint, prompts, params, False, loops=4, exit_policy=policy)
    outputs, stats, steps, _ = chained(tiny_checkpoint, prompts, params, 6, static=True, loops=4,
                                       exit_policy=policy)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert stats.decode_loops == lockstep_stats.decode_loops and steps


def test_chain_graphs_body_with_per_request_loops_and_the_latest_layout(tiny_checkpoint):
    params = [greedy(loops=k) for k in (1, 4, 2)]
    lockstep, _ = run(tiny_checkpoint, PROMPTS[:3], params, False, loops=4, kv_layout="latest")
    outputs, _, steps, _ = chained(tiny_checkpoint, PROMPTS[:3], params, 5, static=True, loops=4,
                                   kv_layout="latest")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert steps


def test_per_request_loops_and_the_latest_layout_give_the_lockstep_tokens(tiny_checkpoint):
    params = [greedy(loops=k) for k in (1, 4, 2, 3)]
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=4, kv_layout="latest")
    outputs, _, steps, _ = chained(tiny_checkpoint, PROMPTS, params, 3, loops=4, kv_layout="latest")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert steps
    assert [c.depth.loops_per_token for c in outputs] == [1, 4, 2, 3]


def test_a_stop_inside_a_chain_drops_the_tokens_after_it(tiny_checkpoint):
    """Each request stops at a token it generates mid-chain (its lockstep output's fourth): its output ends
    there, as lockstep's does with the same stop, and the tokens the chain computed after it are dropped."""
    free = run(tiny_checkpoint, PROMPTS, greedy(), False, loops=4)[0]
    params = [greedy(stop_token_ids=[c.token_ids[3]], ignore_eos=True) for c in free]
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=4)
    outputs, _, steps, _ = chained(tiny_checkpoint, PROMPTS, params, 8, loops=4)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert [c.finish_reason for c in outputs] == [c.finish_reason for c in lockstep]
    assert all(len(c.token_ids) <= 4 for c in outputs) and steps


def test_a_row_that_cannot_chain_makes_its_step_one_pass(tiny_checkpoint):
    """A request that asks for logprobs reads its logits on the host: steps it decodes in run one pass, and
    every request still gets lockstep's tokens."""
    params = [greedy(logprobs=1)] + [greedy()] * 3
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=4, exit_policy="early:0.5")
    outputs, _, steps, _ = chained(tiny_checkpoint, PROMPTS, params, 8, loops=4, exit_policy="early:0.5")
    assert [c.token_ids for c in outputs] == [c.token_ids for c in lockstep]
    assert outputs[0].logprobs is not None and len(outputs[0].logprobs) == NEW_TOKENS
    assert all(rows < len(PROMPTS) for rows in steps)  # no chain ever held the logprobs request's row


def test_staggered_arrivals_join_chained_rows(tiny_checkpoint):
    """Requests added while the others' chains run are prefilled beside them and join the next chain."""
    params = greedy(max_tokens=7)
    lockstep, _ = run(tiny_checkpoint, PROMPTS, params, False, loops=3, exit_policy="early:0.5")
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=3, exit_policy="early:0.5",
                max_num_batched_tokens=6, depth_batching=True, passes_per_step=4, verbose=False) as engine:
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(prompt, params, str(i))
        finished = {}
        for step in range(200):
            if step == 3:
                for i, prompt in enumerate(PROMPTS[2:], start=2):
                    engine.add_request(prompt, params, str(i))
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if len(finished) == len(PROMPTS):
                break
    assert [finished[str(i)] for i in range(len(PROMPTS))] == [c.token_ids for c in lockstep]


@pytest.mark.parametrize("options, message", [
    (dict(passes_per_step=4), "passes_per_step=4 chains depth-batched loop passes; it needs depth_batching"),
    (dict(depth_batching=True, passes_per_step=0), "passes_per_step must be a positive integer, got 0"),
    (dict(depth_batching=True, passes_per_step=4, kv_sharing="last"),
     "passes_per_step=4 and kv_sharing='last'"),
])
def test_passes_per_step_is_checked_by_name(tiny_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_checkpoint, device="cpu", verbose=False, **options)


def test_default_chains_four_times_the_loops_under_depth_batching_only(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", loops=3, depth_batching=True, verbose=False) as engine:
        assert engine.engine_config.step_passes == 12
    with Engine(tiny_checkpoint, device="cpu", loops=3, verbose=False) as engine:
        assert engine.engine_config.step_passes == 1


@pytest.mark.parametrize("max_tokens", [2, 3])
def test_a_chain_runs_no_more_passes_than_its_rows_can_use(tiny_checkpoint, max_tokens):
    """max_tokens leaves a row max_tokens - 1 tokens after prefill: at full depth a chain of 8 passes needs
    only 4 a token, so it stops there instead of idling."""
    params = greedy(max_tokens=max_tokens)
    outputs, stats, steps, _ = chained(tiny_checkpoint, PROMPTS[:1], params, 8, loops=4)
    assert len(outputs[0].token_ids) == max_tokens and steps == [1]
    assert stats.decode_passes == stats.decode_loops == 4 * (max_tokens - 1)
