"""Helpers of the reliability tests: deterministic payloads (``common``) and a writer/reader process
script (``worker.py``) the tests start, kill and race against each other."""
