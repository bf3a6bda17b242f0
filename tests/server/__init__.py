"""Tests of the OpenAI-compatible server (a package, so its live server stops when they are done)."""
