"""Command-line apps (Hydra): ``lazytrain-plan`` (``cli.plan``)."""
