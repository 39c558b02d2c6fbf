"""Experiment scripts (absl flags, thin mains); each main calls a plain function that tests call too."""
