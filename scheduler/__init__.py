"""What runs next: requests and their state machine, and the continuous-batching scheduler.

This package never imports the model; it sees token ids, block ids and a detokenize callable.
"""
