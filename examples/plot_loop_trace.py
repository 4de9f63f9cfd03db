"""Plot a completion's loop trace in a notebook: the exit pdf of every generated token as a heat map (loops
down, tokens across), the loop each token read out at, and where each loop's own top token agreed with the
emitted one.

    from engine import Engine, SamplingParams
    from examples.plot_loop_trace import plot_loop_trace
    with Engine(exit_policy="early:0.6") as engine:
        out = engine.generate(["A looped language model"], SamplingParams(max_tokens=32, loop_trace=True))[0]
        plot_loop_trace(out.outputs[0], engine.tokenizer)

    python -m examples.plot_loop_trace --exit-policy early:0.6 --out trace.png   # the same from a shell

matplotlib is imported inside plot_loop_trace only, so importing this module never needs it.
"""

from __future__ import annotations

import argparse

import torch


def plot_loop_trace(completion, tokenizer=None, ax=None, title: str | None = None):
    """Draw `completion.traces` (SamplingParams(loop_trace=True)) on `ax` (a new figure if None); returns ax.

    Cells are p(exit at loop t) for each token; blank cells are loops the token did not run (early:Q).
    A dot marks the loop that produced the token (none under "weighted"); an x marks loops whose own top
    token was the emitted one.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_loop_trace needs matplotlib: pip install matplotlib") from None
    if not completion.traces:
        raise ValueError("this completion has no traces; generate with SamplingParams(loop_trace=True)")
    tensors = completion.trace_tensors()
    pdf = tensors.exit_pdf.T.numpy()  # [loops, tokens]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.35 * pdf.shape[1]), 1.2 + 0.5 * pdf.shape[0]))
    image = ax.imshow(pdf, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="exit probability")
    tokens = range(pdf.shape[1])
    exit_loop = tensors.exit_loop.tolist()
    ax.scatter([i for i in tokens if exit_loop[i] >= 0], [e for e in exit_loop if e >= 0], c="red", s=18,
               label="readout loop")
    agree = tensors.top_token_ids == torch.tensor(completion.token_ids)[:, None]
    hits = agree.nonzero().tolist()
    ax.scatter([i for i, _ in hits], [t for _, t in hits], marker="x", c="white", s=14,
               label="loop's top token = emitted")
    ax.set_yticks(range(pdf.shape[0]))
    ax.set_ylabel("loop")
    if tokenizer is not None:
        ax.set_xticks(list(tokens))
        ax.set_xticklabels([tokenizer.decode([t]) for t in completion.token_ids], rotation=90, fontsize=7)
    else:
        ax.set_xlabel("generated token")
    ax.legend(loc="upper right", fontsize=7)
    if title:
        ax.set_title(title)
    return ax


def main() -> None:
    from engine import Engine, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded tiny model)")
    parser.add_argument("--prompt", default="A looped language model")
    parser.add_argument("--exit-policy", default="full")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="loop_trace.png", help="image file to write")
    args = parser.parse_args()
    with Engine(args.model, device=args.device, exit_policy=args.exit_policy, verbose=False) as engine:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, loop_trace=True)
        completion = engine.generate([args.prompt], params, use_tqdm=False)[0].outputs[0]
        ax = plot_loop_trace(completion, engine.tokenizer, title=f"exit_policy={args.exit_policy}")
    ax.figure.tight_layout()
    ax.figure.savefig(args.out, dpi=150)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
