"""The format's own types: data types, node names, JSON values, the JSON Schemas, and the
zarr-python data-type plugins (the foundation every layer builds on).
"""
