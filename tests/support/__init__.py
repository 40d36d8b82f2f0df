"""Test tooling: offline fixtures (tiny checkpoints, a tokenizer trained on the fly) and the
crash-and-resume harness. Imported as `support`: pytest puts tests/ on sys.path through its
conftest; scripts insert tests/ themselves."""
