"""Small helpers every layer uses: byte sizes as people write them, progress for long runs."""
