"""The shared tar cache: publish, load, the entries on shared storage, the rebuild fallback."""
