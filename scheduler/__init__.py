"""What runs next: the continuous-batching scheduler (the request types it moves are request.py's).

This package never imports the model or the step runner; it sees token ids, block ids and a detokenizer.
"""
