"""Reference implementations of scaled dot-product attention: one standalone file per framework."""
