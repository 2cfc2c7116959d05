"""A Tinker-compatible training service: the official `tinker` SDK (and tinker-cookbook) against this project's
trainer and engine. `python -m train.tinker_service --help`; docs/tinker.md."""
