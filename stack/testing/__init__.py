"""Test helpers shipped with the package (tiny local model dirs, fake workers)."""
