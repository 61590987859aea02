"""One actor per file. Each is a thin Ray wrapper over a plain class that tests use without Ray."""
