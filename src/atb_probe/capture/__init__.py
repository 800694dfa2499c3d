"""The torch adapter: everything that imports torch lives in this package."""
