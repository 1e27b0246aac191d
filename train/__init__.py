"""Training scripts of the bundled demo pair (models/demo): corpus + tokenizer, target, drafter, eval.

Each script runs as ``python -m train.<name> --out models/demo``; see train/README.md.
"""
