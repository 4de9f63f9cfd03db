"""Exit policies (docs/ouro.md §4, docs/looped_controls.md): which loop's state a token reads out, and
(early:Q and the exit criteria) when a generated token stops looping. The policy strings and their parsing,
the exit criteria's names, "auto" thresholds and check schedule, which policy a request reads out under, the
exit gate's pdf, the per-row readout that turns per-loop states into logits, and per-token loop traces, in one
module. It reads per-loop states; it never runs the network or decides which loops run (runner/loop_driver.py
does). It imports nothing of the engine, so every layer, request.py's SamplingParams included, may use it.

The exit pdf and CDF are computed in float64, one loop at a time, in the same order as tests/reference.py;
only the `hf` policy computes them in the model dtype, as the official remote code does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

# The exit criteria (model/exit_criteria.py holds their math): each compares a generated token's successive
# checked loops. "auto" thresholds: those of the official Huginn code (seal-rg/recurrent-pretraining,
# recpre/raven_modeling_minimal.py, its exit evaluator classes) at c1fbabc (Jul 2025), unchanged at 59e0b69
# (Oct 2025); the Feb-Jun 2025 revisions and the model card used kl 5e-4 and minp-kl 1e-6. argmax-stability's
# is a count of checks.
AUTO_THRESHOLDS: dict[str, float] = {"kl": 1e-3, "minp-kl": 1e-5, "entropy-diff": 1e-3, "latent-diff": 0.03,
                                     "argmax-stability": 5, "cosine": 1e-3}
READS_LOGITS = ("kl", "minp-kl", "entropy-diff", "argmax-stability")
READS_STATE = ("latent-diff", "cosine")
CRITERIA = READS_LOGITS + READS_STATE
EXIT_POLICY_KINDS = ("full", "threshold", "step", "weighted", "early", "hf") + CRITERIA


@dataclasses.dataclass(frozen=True, slots=True)
class ExitPolicy:
    """Which loop's state a token reads out, and (early:Q and the criteria) when a generated token stops
    looping.

        full          every loop, read out after the last (the default; what vLLM does)
        threshold:Q   HF's Q-exit: the first loop whose exit CDF reaches Q; Q >= 1 means the last loop
        step:K        HF's exit_at_step: loop K, 0-based
        weighted      expected logits, sum_t p(t) lm_head(H[t])
        early:Q       threshold:Q's readout, but generated tokens stop looping at that loop (engine-wide)
        hf, hf:Q      the official remote code's Q-exit bit for bit: its exit CDF in the model dtype, Q from
                      the config's early_exit_threshold (hf) or given (hf:Q); in bf16 the CDF can round to 1
                      before the last loop, so even Q = 1 may read out an earlier loop

        C[:T][,min=M][,every=N]
                      an exit criterion C (kl, minp-kl, entropy-diff, argmax-stability, latent-diff, cosine):
                      a generated token stops at the first checked loop where C's value against the previous
                      checked loop is below T (argmax-stability: its argmax has held for T checks), and reads
                      out there (engine-wide). T: a number or "auto" (the default, AUTO_THRESHOLDS). Loop t
                      (0-based) is checked when t >= M and (t - M) % N == 0 (the official min_steps and
                      check_criterion_every_n_steps; defaults 0 and 1)

    threshold:Q computes the CDF in float64, where Q = 1 is never reached early; hf keeps HF's rounding.
    """

    kind: str
    value: float | int | None = None
    min_loops: int = 0  # a criterion's first checked loop (0-based): the official min_steps
    check_every: int = 1  # a criterion checks every check_every-th loop from min_loops on

    @property
    def readout_only(self) -> bool:
        """True when the policy only picks what to read out; early:Q and the criteria also change what is
        computed."""
        return self.kind != "early" and not self.is_criterion

    @property
    def is_criterion(self) -> bool:
        """True for an exit criterion (kl, entropy-diff, ...), which compares a token's checked loops."""
        return self.kind in CRITERIA

    @property
    def can_exit(self) -> bool:
        """True when a generated token may stop looping before the last loop (early:Q with Q < 1, a
        criterion)."""
        return self.is_criterion or (self.kind == "early" and float(self.value) < 1.0)

    def is_checked(self, loop: int) -> bool:
        """Does a criterion check loop `loop` (0-based)?"""
        return loop >= self.min_loops and (loop - self.min_loops) % self.check_every == 0

    def readout_loop(self, loops: int) -> int:
        """The loop a criterion's generated token that never exits reads out, of `loops`: the last one, except
        for a criterion that reads logits when the last loop is not checked: then the last checked loop,
        whose readout the check made (the official code keeps it rather than reading out again)."""
        last = loops - 1
        if self.kind not in READS_LOGITS or self.is_checked(last):
            return last
        checked = [t for t in range(last) if self.is_checked(t)]
        return checked[-1] if checked else last

    def __str__(self) -> str:
        text = self.kind if self.value is None else f"{self.kind}:{self.value}"
        if self.min_loops:
            text += f",min={self.min_loops}"
        if self.check_every != 1:
            text += f",every={self.check_every}"
        return text


FULL = ExitPolicy("full")


@functools.lru_cache(maxsize=256)
def parse_exit_policy(spec: str | ExitPolicy, loops: int | None = None,
                      name: str = "exit_policy") -> ExitPolicy:
    """'full' | 'threshold:Q' | 'step:K' | 'weighted' | 'early:Q' | 'hf' | 'hf:Q' | a criterion
    'C[:T][,min=M][,every=N]'. With `loops`, step:K and min=M are range-checked. Raises ValueError naming
    `name`."""
    if isinstance(spec, ExitPolicy):
        spec = str(spec)
    usage = ("use 'full', 'threshold:Q', 'step:K', 'weighted', 'early:Q', 'hf', 'hf:Q' or an exit criterion "
             f"'C[:T][,min=M][,every=N]' with C one of {', '.join(CRITERIA)}")
    if not isinstance(spec, str):
        raise ValueError(f"{name} must be a string ({usage}), got {spec!r}")
    head, *options = spec.strip().split(",")
    kind, colon, arg = head.strip().partition(":")
    if kind not in EXIT_POLICY_KINDS:
        raise ValueError(f"{name} {spec!r} is not an exit policy; {usage}")
    if kind in CRITERIA:
        return parse_criterion(spec, kind, arg if colon else "auto", options, loops, name)
    if options:
        raise ValueError(f"{name} {spec!r}: {kind!r} takes no ',' options (min= and every= are an exit "
                         "criterion's)")
    if kind == "hf" and not colon:
        return ExitPolicy("hf")  # Q: the config's early_exit_threshold, read at readout
    if kind in ("full", "weighted"):
        if colon:
            raise ValueError(f"{name} {spec!r}: {kind!r} takes no argument")
        return ExitPolicy(kind)
    if kind == "step":
        try:
            step = int(arg)
        except ValueError:
            raise ValueError(f"{name} {spec!r}: step:K needs an integer loop index K (0-based)") from None
        if step < 0 or (loops is not None and step >= loops):
            bound = f"< loops ({loops})" if loops is not None else "a loop index"
            raise ValueError(f"{name} {spec!r}: K must be >= 0 and {bound}")
        return ExitPolicy("step", step)
    try:
        q = float(arg)
    except ValueError:
        raise ValueError(f"{name} {spec!r}: {kind}:Q needs a number Q (an exit CDF level, 0 <= Q; "
                         "Q >= 1 means the last loop)") from None
    if not math.isfinite(q) or q < 0:
        raise ValueError(f"{name} {spec!r}: Q must be a finite number >= 0")
    return ExitPolicy(kind, q)


def parse_criterion(spec: str, kind: str, threshold: str, options: list[str], loops: int | None,
                    name: str) -> ExitPolicy:
    """An exit criterion's policy from its parts: the threshold text after ':' and the ',' options."""
    if threshold.strip() == "auto":
        value = AUTO_THRESHOLDS[kind]
    else:
        try:
            value = float(threshold)
        except ValueError:
            raise ValueError(f"{name} {spec!r}: {kind}:T needs a threshold T, a number or 'auto'") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} {spec!r}: {kind}'s threshold must be a finite number > 0")
    if kind == "argmax-stability":
        if value != int(value):
            raise ValueError(f"{name} {spec!r}: argmax-stability counts checks, its threshold must be a "
                             "whole number")
        value = int(value)
    schedule = {"min": 0, "every": 1}
    for option in options:
        key, equals, text = option.strip().partition("=")
        if key not in schedule or not equals:
            raise ValueError(f"{name} {spec!r}: unknown option {option.strip()!r}; a criterion takes min=M "
                             "(its first checked loop, 0-based) and every=N (check every N-th loop)")
        try:
            schedule[key] = int(text)
        except ValueError:
            raise ValueError(f"{name} {spec!r}: {key}= needs an integer, got {text!r}") from None
    if schedule["min"] < 0 or schedule["every"] < 1:
        raise ValueError(f"{name} {spec!r}: need min >= 0 and every >= 1")
    if loops is not None and schedule["min"] >= loops:
        raise ValueError(f"{name} {spec!r}: min={schedule['min']} must be < loops ({loops}), else no loop is "
                         "checked")
    return ExitPolicy(kind, value, schedule["min"], schedule["every"])


def request_policy(spec: str | None, engine_policy: ExitPolicy, loops: int) -> ExitPolicy:
    """The policy one request reads out under: its own readout-only override, else the engine's."""
    if spec is None:
        return engine_policy
    policy = parse_exit_policy(spec, loops, "SamplingParams.exit_policy")
    if not policy.readout_only:
        raise ValueError(f"SamplingParams.exit_policy {spec!r}: {policy.kind} stops tokens early, which "
                         "changes the K/V every later token reads, so it is engine-wide; pass it as "
                         "Engine(exit_policy=...)")
    if not engine_policy.readout_only:
        raise ValueError(f"SamplingParams.exit_policy {spec!r}: this engine runs {engine_policy}, whose "
                         "readout is fixed; per-request policies need a readout-only engine policy")
    return policy



# -- traces -----------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class LoopTrace:
    """One generated token's loops, as plain lists (one entry per loop this token ran).

    exit_pdf[t]: the gate's exit probability at loop t (float64 math; under early:Q only the loops the
    token ran, so the list may be shorter and sum to less than 1). exit_loop: the loop whose readout gave
    the logits (None under "weighted", which mixes every loop). top_token_ids[t] / top_logprobs[t]: the
    argmax token of loop t's own logits and its log-probability. A model without a gate that reads out
    through a coda (Huginn) traces only under an exit criterion (coda_traces): NaN exit_pdf, one per loop
    run, and no top tokens.
    """

    exit_pdf: list[float]
    exit_loop: int | None
    top_token_ids: list[int]
    top_logprobs: list[float]
    # Under speculative decoding: "accepted" (a draft the full model confirmed) or "target" (the full model's
    # own token, where it rejected a draft or where no draft was made). None: no speculation.
    draft: str | None = None


@dataclasses.dataclass(slots=True)
class TraceTensors:
    """A completion's traces stacked, NaN / -1 padded to the longest: exit_pdf, top_logprobs [N, T]
    float64; top_token_ids [N, T] int64; exit_loop [N] int64 (-1 for None); loops_run [N] int64."""

    exit_pdf: torch.Tensor
    exit_loop: torch.Tensor
    loops_run: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


def stack_traces(traces: list[LoopTrace]) -> TraceTensors:
    width = max((len(t.exit_pdf) for t in traces), default=0)

    def padded(rows: list[list], fill: float | int, dtype: torch.dtype) -> torch.Tensor:
        values = [row + [fill] * (width - len(row)) for row in rows]
        return torch.tensor(values, dtype=dtype).view(len(rows), width)

    return TraceTensors(
        exit_pdf=padded([t.exit_pdf for t in traces], math.nan, torch.float64),
        exit_loop=torch.tensor([-1 if t.exit_loop is None else t.exit_loop for t in traces],
                               dtype=torch.int64),
        loops_run=torch.tensor([len(t.exit_pdf) for t in traces], dtype=torch.int64),
        top_token_ids=padded([t.top_token_ids for t in traces], -1, torch.int64),
        top_logprobs=padded([t.top_logprobs for t in traces], math.nan, torch.float64),
    )



# -- the readout ------------------------------------------------------------------------------------

def exit_pdf(gate_logits: torch.Tensor, loops: int | None = None) -> torch.Tensor:
    """[t, R] gate logits of the first t loops -> [t, R] float64 exit pdf. p(t) = lambda_t S_{t-1}; the
    last of `loops` (default: t) takes the remaining mass. NaN gates (loops not run) give NaN."""
    loops = gate_logits.shape[0] if loops is None else loops
    lam = torch.sigmoid(gate_logits.double())
    survival = torch.ones_like(lam[0])
    pdf = []
    for t in range(gate_logits.shape[0]):
        if t == loops - 1:
            pdf.append(survival)
        else:
            pdf.append(lam[t] * survival)
            survival = survival * (1.0 - lam[t])
    return torch.stack(pdf)


def threshold_exit_loops(pdf: torch.Tensor, q: float) -> torch.Tensor:
    """[T, R] pdf -> [R] int64: the first loop whose CDF reaches q, else the last; q >= 1: the last.
    Rows whose later loops did not run (NaN) exit where their CDF first reached q."""
    loops, rows = pdf.shape
    exit_loop = torch.full((rows,), loops - 1, dtype=torch.int64, device=pdf.device)
    if q >= 1.0:
        return exit_loop
    cdf = torch.zeros_like(pdf[0])
    done = torch.zeros(rows, dtype=torch.bool, device=pdf.device)
    for t in range(loops - 1):
        cdf = cdf + pdf[t]
        hit = ~done & (cdf >= q)
        exit_loop[hit] = t
        done |= hit
    return exit_loop


def hf_exit_loops(gate_logits: torch.Tensor, q: float | None) -> torch.Tensor:
    """[T, R] gate logits in the model dtype -> [R] int64: the official remote code's Q-exit, with its
    arithmetic in the model dtype and in its order: lambda = sigmoid(gate); p(t) = lambda * S, S = S * (1 -
    lambda), the last loop taking S; CDF = torch.cumsum over the loops, compared with q in the model dtype
    (a Python float meets a tensor in the tensor's dtype); the first loop whose CDF >= q, else the last.
    Every op is elementwise per row or a scan along the loops, so a row's bits do not depend on the batch.
    q None (a config whose early_exit_threshold is null): HF reads out the last loop."""
    loops, rows = gate_logits.shape
    if q is None:
        return torch.full((rows,), loops - 1, dtype=torch.int64, device=gate_logits.device)
    remaining = torch.ones_like(gate_logits[0])
    pdf = []
    for t in range(loops):
        lam = torch.sigmoid(gate_logits[t])
        if t < loops - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    reached = torch.cumsum(torch.stack(pdf, dim=1), dim=1) >= q  # [R, T]
    exit_loop = torch.argmax(reached.float(), dim=1)
    exit_loop[~reached.any(dim=1)] = loops - 1
    return exit_loop


def exit_loops(policy: ExitPolicy, pdf: torch.Tensor) -> torch.Tensor:
    """[R] int64 readout loop of each row under a policy other than weighted, hf and the criteria."""
    loops, rows = pdf.shape
    if policy.kind in ("threshold", "early"):
        return threshold_exit_loops(pdf, float(policy.value))
    loop = policy.value if policy.kind == "step" else loops - 1
    return torch.full((rows,), loop, dtype=torch.int64, device=pdf.device)


def readout_logits(lm_head, hidden: torch.Tensor, gate_logits: torch.Tensor, policies: list[ExitPolicy],
                   traced: list[bool], config_threshold: float | None = 1.0
                   ) -> tuple[torch.Tensor, list[LoopTrace | None]]:
    """Logits [R, V] (fp32) of the sampling rows under each row's policy, and a trace for each traced row.

    hidden [T, R, H], gate_logits [T, R] (the model dtype): LoopStates of the sampling rows only, so no row
    that does not sample pays for a readout. Loops a row did not run (early:Q) have NaN gates and repeat the
    hidden state of its last loop. `lm_head` maps [*, H] -> [*, V]. config_threshold: the checkpoint's
    early_exit_threshold, the Q of a plain `hf` policy.
    """
    loops, rows = gate_logits.shape
    if not any(traced) and all(p.kind == "full" for p in policies):
        return lm_head(hidden[-1]).float(), [None] * rows
    pdf = exit_pdf(gate_logits)
    loop_of = torch.full((rows,), loops - 1, dtype=torch.int64, device=hidden.device)
    for policy in set(policies):
        chosen = [r for r, p in enumerate(policies) if p == policy]
        if policy.kind == "hf":
            q = config_threshold if policy.value is None else float(policy.value)
            loop_of[chosen] = hf_exit_loops(gate_logits[:, chosen], q).to(hidden.device)
        elif policy.is_criterion:
            loop_of[chosen] = criterion_exit_loops(policy, gate_logits[:, chosen]).to(hidden.device)
        elif policy.kind != "weighted":
            loop_of[chosen] = exit_loops(policy, pdf[:, chosen]).to(hidden.device)
    logits = lm_head(hidden[loop_of, torch.arange(rows, device=hidden.device)]).float()
    weighted = [r for r, p in enumerate(policies) if p.kind == "weighted"]
    if weighted:
        logits[weighted] = expected_logits(lm_head, hidden[:, weighted], pdf[:, weighted])
    traces: list[LoopTrace | None] = [None] * rows
    chosen = [r for r in range(rows) if traced[r]]
    if chosen:
        exit_loop = [None if policies[r].kind == "weighted" else int(loop_of[r]) for r in chosen]
        for r, trace in zip(chosen, loop_traces(lm_head, hidden[:, chosen], gate_logits[:, chosen],
                                                 pdf[:, chosen], exit_loop)):
            traces[r] = trace
    return logits, traces


def criterion_exit_loops(policy: ExitPolicy, gate_logits: torch.Tensor) -> torch.Tensor:
    """[T, R] gate logits of generated tokens under a criterion -> [R] int64 readout loops: where a row
    stopped (the last loop whose gate is not NaN), or the criterion's readout_loop for a row that ran every
    loop."""
    ran = (~gate_logits.isnan()).sum(dim=0)
    return torch.clamp(ran - 1, max=policy.readout_loop(gate_logits.shape[0]))


def coda_traces(gate_logits: torch.Tensor | None, policies: list[ExitPolicy], traced: list[bool]
                ) -> list[LoopTrace | None]:
    """LoopTraces of rows read out through a coda by a model without an exit gate (Huginn) under an exit
    criterion: each traced row's loops run and its readout loop (criterion_exit_loops; the last loop under
    another policy), with NaN exit pdfs (there is no gate) and no per-loop top tokens (a loop's own logits
    would need a coda pass, whose attention stores K/V). gate_logits [T, R]: the loop driver's zeros where
    a row ran, NaN from where it stopped (None: no trace to give)."""
    if gate_logits is None or not any(traced):
        return [None] * len(policies)
    loops = gate_logits.shape[0]
    ran = (~gate_logits.isnan()).sum(dim=0).tolist()
    traces: list[LoopTrace | None] = []
    for r, (policy, wanted) in enumerate(zip(policies, traced)):
        if not wanted:
            traces.append(None)
            continue
        loop = int(criterion_exit_loops(policy, gate_logits[:, r:r + 1])[0]) if policy.is_criterion \
            else loops - 1
        traces.append(LoopTrace([math.nan] * ran[r], loop, [], []))
    return traces


def expected_logits(lm_head, hidden: torch.Tensor, pdf: torch.Tensor) -> torch.Tensor:
    """sum_t p(t) lm_head(H[t]) in fp32, summed in loop order as the oracle does. hidden [T, W, H]."""
    weights, per_loop = pdf.float(), lm_head(hidden).float()
    mixed = torch.zeros_like(per_loop[0])
    for t in range(per_loop.shape[0]):
        mixed = mixed + weights[t, :, None] * per_loop[t]
    return mixed


def loop_traces(lm_head, hidden: torch.Tensor, gate_logits: torch.Tensor, pdf: torch.Tensor,
                exit_loop: list[int | None]) -> list[LoopTrace]:
    """LoopTraces of C rows: hidden [T, C, H], gate_logits and pdf [T, C]; loops not run are NaN gates."""
    top_logprobs, top_ids = torch.log_softmax(lm_head(hidden).float(), dim=-1).max(dim=-1)  # [T, C]
    ran = (~gate_logits.isnan()).sum(0).tolist()
    rows = zip(ran, pdf.T.tolist(), exit_loop, top_ids.T.tolist(), top_logprobs.double().T.tolist())
    return [LoopTrace(p[:n], e, ids[:n], lps[:n]) for n, p, e, ids, lps in rows]


def constant_gate_bias(exit_loop: int, q: float) -> float:
    """The gate bias that, with a zero gate weight (lambda constant for every token), makes early:q exit every
    generated token after loop `exit_loop` (0-based): CDF(t) = 1 - (1 - lambda)^(t+1) first reaches q there.
    For benchmarks and tests that need a known exit pattern from random weights."""
    if not 0.0 < q < 1.0 or exit_loop < 0:
        raise ValueError(f"need 0 < q < 1 and exit_loop >= 0, got q={q!r}, exit_loop={exit_loop!r}")
    lam = 1.0 - (1.0 - q) ** (1.0 / (exit_loop + 0.5))  # halfway (in log survival) between two loops
    return math.log(lam / (1.0 - lam))


def force_exit_loop(model: torch.nn.Module, exit_loop: int, q: float) -> None:
    """Zero the exit gate's weight and set its bias to constant_gate_bias(exit_loop, q), in place."""
    with torch.no_grad():
        model.early_exit_gate.weight.zero_()
        model.early_exit_gate.bias.fill_(constant_gate_bias(exit_loop, q))
