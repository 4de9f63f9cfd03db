"""The exit criteria as exit policies (kl, minp-kl, entropy-diff, argmax-stability, latent-diff, cosine; with
min= and every=), against a per-token adaptive loop written plainly here on top of tests/reference.py's dense
fp32 network: one token at a time, loop by loop, the criterion's value against the previous checked loop,
stop, copy the token's K/V forward into the loops it skipped, read out where it stopped (or, never stopping,
at the last loop; a criterion that reads logits at the last *checked* loop), as the official Huginn code's
adaptive generation does per sequence at batch 1. Greedy tokens, each token's exit loop and the loops it ran
must be identical; the batch mixes prefill chunks and decode rows, so the eager hook finds its rows among
other rows' tokens.

Random tiny weights settle slowly and alike for every criterion (values fall loop by loop), so each test takes
its threshold from the reference's own values over the same prompts (a quantile of what the criterion reads
at its checked loops), which gives a mix of tokens that exit early and tokens that run every loop; the tests
assert that mix, so that none passes by never exiting.
"""


import pytest
import torch

from engine import Engine, SamplingParams
from exit_policy import CRITERIA, READS_LOGITS, ExitPolicy, parse_exit_policy
from runner.exit_rules import check_readout
from model.exit_criteria import ExitCriterion
from model.tokenizer import Tokenizer
from tests.reference import ReferenceOuro, rms_norm

PROMPTS = ["A looped language model", "Hello", "The quick brown fox jumps over the lazy dog again",
           "0123456789 + - * / = 42"]
LOOPS = 6  # beyond the 4 loops the tiny config names, for room to schedule checks
NEW_TOKENS = 8
pytestmark = pytest.mark.filterwarnings("ignore:loops=6 exceeds")


class AdaptiveReference:
    """The per-token adaptive loop over tests/reference.py's network, kv[t][l][position] = (k, v) as
    ReferenceOuro.decode keeps it. Prompt tokens run every loop; a generated token is checked at the loops
    the policy checks, t < loops - 1."""

    def __init__(self, reference: ReferenceOuro) -> None:
        self.ref = reference
        self.vocab = reference.lm_head.shape[0]

    def decode(self, prompt: list[int], new_tokens: int, policy: ExitPolicy
               ) -> tuple[list[int], list[int], list[int], list[tuple[int, float]]]:
        """Greedy tokens; per token its readout loop and the loops it ran (the first: the last prompt
        token's); and (loop, value) of every value the criterion computed at a generated token's checks."""
        ref = self.ref
        kv = [[[] for _ in range(ref.layers)] for _ in range(ref.loops)]
        ids, out, readout_loops, ran, values = list(prompt), [], [], [], []
        for pos in range(len(prompt) + new_tokens - 1):
            generated = pos >= len(prompt)
            states, exit_loop = self.token_loops(ids[pos], pos, kv, policy if generated else None, values)
            if pos < len(prompt) - 1:
                continue
            readout_loops.append(exit_loop)
            ran.append(len(states))
            out.append(int((states[exit_loop] @ ref.lm_head.T).argmax()))
            ids.append(out[-1])
        return out, readout_loops, ran, values

    def token_loops(self, token: int, pos: int, kv: list, policy: ExitPolicy | None,
                    values: list[tuple[int, float]]) -> tuple[list[torch.Tensor], int]:
        """One token's loop states and its readout loop."""
        ref, w, eps = self.ref, self.ref.w, self.ref.eps
        h = w["model.embed_tokens.weight"][token][None]
        memory = self.start(policy.kind, h[0]) if policy is not None else None
        states = []
        for t in range(ref.loops):
            for i in range(ref.layers):
                h = ref.layer(h, i, torch.tensor([pos]), kv[t][i], lambda store=kv[t][i]: store)
            h = rms_norm(h, w["model.norm.weight"], eps)
            states.append(h[0])
            if policy is None or t == ref.loops - 1 or not policy.is_checked(t):
                continue
            value, memory = self.value(policy.kind, memory, h[0])
            values.append((t, value))
            if value >= policy.value if policy.kind == "argmax-stability" else value < policy.value:
                for later in range(t + 1, ref.loops):  # copy-forward: deeper loops read loop t's K/V
                    for i in range(ref.layers):
                        kv[later][i].append(kv[t][i][pos])
                return states, t
        last = ref.loops - 1
        return states, last if policy is None else policy.readout_loop(ref.loops)

    def start(self, kind: str, embedding: torch.Tensor):
        """What the first check compares with: a uniform distribution (kl, minp-kl), entropy 100, no argmax
        (a run of 0), or the token's initial state, its embedding."""
        if kind in ("kl", "minp-kl"):
            return torch.full((self.vocab,), 1.0 / self.vocab)
        return {"entropy-diff": 100.0, "argmax-stability": (-1, 0)}.get(kind, embedding)

    def value(self, kind: str, previous, state: torch.Tensor):
        if kind in READS_LOGITS:
            probs = torch.softmax(state @ self.ref.lm_head.T, dim=-1)
        if kind == "kl" or kind == "minp-kl":
            if kind == "minp-kl":  # below a tenth of the top probability: 1/V, renormalised
                probs = torch.where(probs < 0.1 * probs.max(), 1.0 / self.vocab, probs)
                probs = probs / probs.sum()
            return float((previous * (previous.log() - probs.log())).sum()), probs
        if kind == "entropy-diff":
            entropy = float(-(probs * torch.log(probs + 1e-10)).sum())
            return abs(entropy - previous), entropy
        if kind == "argmax-stability":
            argmax, run = int(probs.argmax()), previous[1]
            run = run + 1 if argmax == previous[0] else 0
            return run, (argmax, run)
        if kind == "latent-diff":
            return float((state - previous).norm() / state.norm()), state
        return float(1 - state @ previous / (state.norm() * previous.norm())), state  # cosine


@pytest.fixture(scope="module")
def adaptive(tiny_checkpoint):
    return AdaptiveReference(ReferenceOuro(tiny_checkpoint, loops=LOOPS))


def run_engine(checkpoint, policy: str, traced: bool = True):
    """Greedy tokens, traces and loop stats of the four prompts, prefilled in chunks of 6 tokens beside decode
    rows."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, loop_trace=traced)
    with Engine(checkpoint, device="cpu", dtype="float32", loops=LOOPS, exit_policy=policy,
                max_num_batched_tokens=6, verbose=False) as engine:
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        stats = engine.loop_stats
    return [out.outputs[0] for out in outputs], prompt_ids, stats


def threshold_for(adaptive: AdaptiveReference, prompt_ids: list[list[int]], policy: ExitPolicy) -> float:
    """A threshold that stops some generated tokens early and not others: halfway between the two middle
    values the criterion reads at its last check before the last loop when nothing exits, so that no value
    lies within rounding of it (argmax-stability: a run of 1)."""
    if policy.kind == "argmax-stability":
        return 1
    never = ExitPolicy(policy.kind, 1e-30, policy.min_loops, policy.check_every)
    checks = [check for ids in prompt_ids for check in adaptive.decode(ids, NEW_TOKENS, never)[3]]
    last = max(t for t, _ in checks)
    values = sorted(value for t, value in checks if t == last)
    return (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def check_against_reference(checkpoint, adaptive: AdaptiveReference, policy: ExitPolicy
                            ) -> list[tuple[list[int], list[int]]]:
    """The engine's greedy tokens, readout loops, loops run and loop stats equal the reference's; returns the
    reference's (readout loops, loops run) per prompt."""
    completions, prompt_ids, stats = run_engine(checkpoint, str(policy))
    seen, decode_loops = [], 0
    for ids, completion in zip(prompt_ids, completions):
        tokens, readout_loops, ran, _ = adaptive.decode(ids, NEW_TOKENS, policy)
        assert completion.token_ids == tokens
        assert [trace.exit_loop for trace in completion.traces] == readout_loops
        assert [len(trace.exit_pdf) for trace in completion.traces] == ran
        seen.append((readout_loops, ran))
        decode_loops += sum(ran[1:])
    assert stats.decode_loops == decode_loops
    return seen


@pytest.mark.parametrize("kind", CRITERIA)
def test_each_criterion_gives_the_per_token_references_tokens_and_exit_loops(tiny_checkpoint, adaptive, kind):
    prompt_ids = _prompt_ids(tiny_checkpoint)
    threshold = threshold_for(adaptive, prompt_ids, ExitPolicy(kind, 1.0))
    policy = parse_exit_policy(f"{kind}:{threshold!r}", LOOPS)
    seen = check_against_reference(tiny_checkpoint, adaptive, policy)
    generated_ran = [n for _, ran in seen for n in ran[1:]]
    assert min(generated_ran) < LOOPS and max(generated_ran) == LOOPS  # some stop early, some never do


def test_min_loops_and_every_n_schedule_the_checks_and_the_readout(tiny_checkpoint, adaptive):
    """kl,min=2,every=2 over 6 loops checks loops 2 and 4 (5 is the last, and not on the schedule): a token
    stops only there, and one that never stops ran all 6 loops but reads out at loop 4, the last check's, as
    the official code does."""
    prompt_ids = _prompt_ids(tiny_checkpoint)
    threshold = threshold_for(adaptive, prompt_ids, ExitPolicy("kl", 1.0, 2, 2))
    policy = parse_exit_policy(f"kl:{threshold!r},min=2,every=2", LOOPS)
    assert (policy.min_loops, policy.check_every, policy.readout_loop(LOOPS)) == (2, 2, 4)
    seen = check_against_reference(tiny_checkpoint, adaptive, policy)
    generated = [(loop, n) for loops, ran in seen for loop, n in zip(loops[1:], ran[1:])]
    assert {n for _, n in generated} <= {3, 5, LOOPS} and {3, 5} & {n for _, n in generated}
    assert all(loop == 4 for loop, n in generated if n == LOOPS)
    assert any(n == LOOPS for _, n in generated)


@pytest.mark.parametrize("policy", ["kl:0.15,min=2,every=2", "latent-diff:0.4"])
def test_untraced_rows_read_out_where_traced_rows_do(tiny_checkpoint, policy):
    """Without traces a criterion row reads out its last state as `full` does where its readout loop is
    where it stopped or the last (latent-diff), else through the criterion's readout loop: the same tokens
    as traced rows."""
    traced = [c.token_ids for c in run_engine(tiny_checkpoint, policy)[0]]
    assert [c.token_ids for c in run_engine(tiny_checkpoint, policy, traced=False)[0]] == traced


def _prompt_ids(checkpoint) -> list[list[int]]:
    tokenizer = Tokenizer(checkpoint)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("spec, message", [
    ("kl:abc", "'kl:abc': kl:T needs a threshold T"),
    ("entropy-diff:-1", "threshold must be a finite number > 0"),
    ("argmax-stability:2.5", "argmax-stability counts checks"),
    ("latent-diff:auto,min=6", "min=6 must be < loops (6)"),
    ("kl,every=0", "need min >= 0 and every >= 1"),
    ("minp-kl,after=3", "unknown option 'after=3'"),
    ("early:0.5,min=2", "'early' takes no ',' options"),
    ("kl-divergence", "'kl-divergence' is not an exit policy"),
])
def test_bad_criterion_strings_are_refused_naming_the_policy(tiny_checkpoint, spec, message):
    with pytest.raises(ValueError, match="exit_policy") as error:
        Engine(tiny_checkpoint, device="cpu", loops=LOOPS, exit_policy=spec, verbose=False)
    assert message in str(error.value)


def test_criteria_are_engine_wide_not_per_request(tiny_checkpoint):
    with Engine(tiny_checkpoint, device="cpu", verbose=False) as engine:
        with pytest.raises(ValueError, match="SamplingParams.exit_policy 'kl:auto': kl stops tokens early"):
            engine.generate(["Hello"], SamplingParams(max_tokens=2, exit_policy="kl:auto"), use_tqdm=False)


def test_auto_thresholds_and_the_policy_string_round_trip():
    assert parse_exit_policy("kl") == parse_exit_policy("kl:auto") == ExitPolicy("kl", 1e-3)
    assert parse_exit_policy("minp-kl").value == 1e-5 and parse_exit_policy("argmax-stability").value == 5
    policy = parse_exit_policy("latent-diff:0.05,min=4,every=2")
    assert str(policy) == "latent-diff:0.05,min=4,every=2" and parse_exit_policy(str(policy)) == policy
    assert policy.can_exit and not policy.readout_only


def test_a_criterion_that_reads_logits_reads_a_coda_models_distribution_through_the_coda_it_is_given():
    """For Huginn a check's logits are the head on the coda's output, the coda run by the caller over the
    checked rows (the eager executor's or the per-loop graph's attention); a latent criterion reads the
    state itself."""

    class WithCoda:
        coda = staticmethod(lambda state, context, attention: state)
        compute_logits = staticmethod(lambda hidden: hidden * 2)

    state = torch.ones(2, 4)
    readout = check_readout(WithCoda(), ExitCriterion("kl", 1e-3))
    assert torch.equal(readout(state, lambda rows: rows + 1), torch.full((2, 4), 4.0))
    with pytest.raises(ValueError, match="kl reads the next-token distribution through the model's coda"):
        readout(state, None)
    assert check_readout(WithCoda(), ExitCriterion("latent-diff", 0.03))(state, None) is state


def graph_and_eager_exits(checkpoint, spec: str, prompts: list[str], loops: int, new_tokens: int,
                          **options) -> None:
    """Per-loop CUDA graphs decide the criterion on the device (rows compacted into smaller buckets as they
    stop) and give the eager steps' tokens, exit loops and readout pdfs, in fp32; some token exits early."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, loop_trace=True)
    results = {}
    for eager in (False, True):
        with Engine(checkpoint, device="cuda", dtype="float32", attention="triton", loops=loops,
                    enforce_eager=eager, exit_policy=spec, verbose=False, **options) as engine:
            assert engine.uses_cuda_graphs != eager
            outputs = engine.generate(prompts, params, use_tqdm=False)
            results[eager] = [(o.outputs[0].token_ids, [t.exit_loop for t in o.outputs[0].traces],
                               [len(t.exit_pdf) for t in o.outputs[0].traces]) for o in outputs]
            assert engine.loop_stats.loops_per_token < loops
    assert results[False] == results[True]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["kl:0.15", "argmax-stability:1,min=1", "latent-diff:1.0,every=2"])
def test_per_loop_graphs_give_the_eager_exit_loops_and_tokens(tiny_checkpoint, spec):
    """8 rows of the tiny Ouro model."""
    graph_and_eager_exits(tiny_checkpoint, spec, PROMPTS * 2, LOOPS, NEW_TOKENS, num_kv_blocks=512)


def test_preempted_requests_replay_their_exits_and_match_the_reference(tiny_checkpoint):
    """A pool too small for all four prompts: preempted requests recompute their generated tokens one per
    step (a token's K/V depends on where the one before it stopped), stop where they stopped the first time,
    and give the reference's tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, loop_trace=True)
    with Engine(tiny_checkpoint, device="cpu", dtype="float32", loops=3, exit_policy="kl:0.5",
                num_kv_blocks=16, block_size=4, enable_prefix_caching=False, admission="greedy",
                max_num_batched_tokens=6, verbose=False) as engine:
        outputs = [o.outputs[0] for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        assert engine.scheduler.num_preemptions > 0
    adaptive = AdaptiveReference(ReferenceOuro(tiny_checkpoint, loops=3))
    ran = []
    for ids, completion in zip(prompt_ids, outputs):
        tokens, readout_loops, loops_run, _ = adaptive.decode(ids, 24, parse_exit_policy("kl:0.5"))
        assert completion.token_ids == tokens
        assert [trace.exit_loop for trace in completion.traces] == readout_loops
        ran += loops_run[1:]
    assert min(ran) < 3 and max(ran) == 3
