"""The tiny model's addition items for lm-evaluation-harness (tiny_addition.jsonl beside this file: the first
16 held-out sums of ../addition.jsonl, each with its answer among three near misses), read from disk so that
nothing is downloaded. The tasks' YAML files name load() as their custom_dataset."""

import json
from pathlib import Path


def load(**kwargs) -> dict:
    import datasets

    lines = (Path(__file__).parent / "tiny_addition.jsonl").read_text().splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines])}
