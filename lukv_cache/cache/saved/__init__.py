"""Saved compressed contexts: a filled cache written to one safetensors file and read back.

* :mod:`.file`: the file (format, checksum, model fingerprint, options, layers);
* :mod:`.layers`: each layer's entry, and the table of tags that name the file's types;
* :mod:`.options_json`: the cache's policy as JSON;
* :mod:`.fingerprint`: the model identity a file is checked against.

The public functions (``save_cache``, ``load_cache``) are :mod:`lukv_cache.cache.save_load`'s, above the
cache they return. The file layout is in docs/saved.md.
"""
