"""Tests written to kill surviving mutants (make mutation); see docs/testing.md."""
