"""lm-evaluation-harness's model `loop-engine`: the Engine in the harness's own process (no server), for
generate_until, loglikelihood and loglikelihood_rolling. A continuation's loglikelihood is the sum of its
tokens' prompt logprobs, and it is greedy when each is the top token (rank 1); requests are tokenized, cut to
length and windowed exactly as lm-eval's local-completions model does against `loop-engine serve`, so the
two routes score the same tokens.

    python -m server.lm_eval_model --model loop-engine \\
        --model_args pretrained=ByteDance/Ouro-1.4B,loops=2,exit_policy=early:0.5 --tasks arc_easy

Importing this module registers the name; `python -m server.lm_eval_model` is lm-eval's command line with it
registered. model_args are Engine arguments, plus batch_size (1, lm-eval's default: each request alone;
N: N at a time; auto: all at once, the scheduler batches them), max_length and max_gen_toks."""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  lm-eval's own models first: its get_model fills only an empty registry
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from engine import Engine, check_engine_kwargs
from request import RequestOutput, SamplingParams
from server.tokenizer_info import eos_token_id, prefix_token_id

NAME = "loop-engine"
# A request's (context, continuation) as lm-eval hands it to _loglikelihood_tokens, token ids included.
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


class LoopEngineLM(TemplateLM):
    def __init__(self, pretrained: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, device: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, **engine_kwargs: Any) -> None:
        super().__init__()
        check_engine_kwargs(engine_kwargs, "model_args")
        self.engine = Engine(pretrained, device=device, verbose=False, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._batch_size = batch_size_of(batch_size, max_batch_size)
        # lm-eval's API models keep one position for the token every request samples; so does this one.
        self.max_length = (max_length or self.engine.max_model_len) - 1
        self.max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int | None:
        return eos_token_id(self.tokenizer)

    @property
    def prefix_token_id(self) -> int | None:
        return prefix_token_id(self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.engine_config.model_dir)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def chat_template(self, chat_template: bool | str = False) -> str:
        template = self.tokenizer.chat_template
        return (template.get("default", "") if isinstance(template, dict) else template) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Each continuation's summed logprob and whether every token of it is the top one, from one
        request per item that samples a single token and returns its prompt's logprobs."""
        inputs, ctxlens = [], []
        for _, context, continuation in requests:
            whole = context + continuation
            inputs.append(whole[-self.max_length:])  # left-truncated as local-completions does
            ctxlens.append(len(context) - max(0, len(whole) - self.max_length))
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outputs = self._run(inputs, [params] * len(inputs), disable_tqdm)
        results = []
        for (cache_key, _, _), tokens, ctxlen, output in zip(requests, inputs, ctxlens, outputs):
            picked = [output.prompt_logprobs[i][tokens[i]] for i in range(ctxlen, len(tokens))]
            answer = (sum(lp.logprob for lp in picked), all(lp.rank == 1 for lp in picked))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's loglikelihood over disjoint windows of max_length - 1 tokens (the first conditioned on
        the prefix token), as local-completions windows it; all windows of all texts run together."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its stop strings or max_gen_toks tokens (greedy unless the task's
        generation_kwargs sample), the context left-truncated as local-completions truncates it."""
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            sampling = generation_params(gen_kwargs, self.max_gen_toks)
            prompts.append(self.tok_encode(context)[-max(self.max_length - sampling.max_tokens, 1):])
            params.append(sampling)
        outputs = self._run(prompts, params, disable_tqdm)
        texts = [output.outputs[0].text for output in outputs]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _run(self, prompts: list[list[int]], params: list[SamplingParams],
             disable_tqdm: bool) -> list[RequestOutput]:
        """Every prompt through Engine.generate, batch_size at a time (None: all at once)."""
        size = self._batch_size or max(len(prompts), 1)
        outputs: list[RequestOutput] = []
        with tqdm(total=len(prompts), desc="loop-engine", disable=disable_tqdm) as progress:
            for start in range(0, len(prompts), size):
                chunk = [{"prompt_token_ids": p} for p in prompts[start:start + size]]
                outputs += self.engine.generate(chunk, params[start:start + size], use_tqdm=False)
                progress.update(len(chunk))
        failed = [(i, out.outputs[0].error) for i, out in enumerate(outputs)
                  if out.outputs[0].finish_reason == "error"]
        if failed:
            raise RuntimeError(f"loop-engine: request {failed[0][0]} failed: {failed[0][1]}")
        return outputs


def batch_size_of(batch_size: int | str, max_batch_size: int | None) -> int | None:
    """lm-eval's batch_size: a positive integer, or "auto": everything at once (None), or max_batch_size."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        return max_batch_size
    try:
        size = int(batch_size)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be a positive integer or auto, got {batch_size!r}") from None
    if size < 1:
        raise ValueError(f"batch_size must be a positive integer or auto, got {batch_size!r}")
    return size


def generation_params(gen_kwargs: dict[str, Any], max_gen_toks: int) -> SamplingParams:
    """A task's generation_kwargs as SamplingParams: until -> stop, max_gen_toks -> max_tokens, greedy unless
    do_sample; the rest are SamplingParams fields (temperature, top_p, top_k, seed, ...)."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    max_tokens = kwargs.pop("max_gen_toks", max_gen_toks)
    do_sample = kwargs.pop("do_sample", False)
    kwargs.setdefault("temperature", 1.0 if do_sample else 0.0)
    try:
        return SamplingParams(stop=[until] if isinstance(until, str) else list(until or []),
                              max_tokens=max_tokens, **kwargs)
    except TypeError:
        unknown = sorted(set(kwargs) - set(SamplingParams.__dataclass_fields__))
        raise ValueError(f"generation_kwargs {unknown} are not SamplingParams fields") from None


def register() -> None:
    """Register `loop-engine` with lm-eval, lazily (by module path, so running this module as __main__
    registers the same class)."""
    model_registry.register(NAME, target=f"server.lm_eval_model:{LoopEngineLM.__name__}")


register()


def main() -> None:
    """lm-eval's command line (`run ...`, or run's arguments alone), with `--model loop-engine` known."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
