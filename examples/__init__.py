"""Runnable examples: `python -m examples.NAME` from the repository root, or from anywhere after
`pip install -e .`; and the notebook. The teaching walkthrough is docs/walkthrough.md."""
