"""The OpenAI-compatible HTTP server (`loop-engine serve`) and lm-evaluation-harness on the engine. This
package sits above the engine: it imports engine.py and request.py, and nothing of the engine imports it;
the command line (cli.py: cli_serve) sits above it and starts it. Needs the `[serve]` extra, and `[eval]` for
lm_eval_model.py."""
