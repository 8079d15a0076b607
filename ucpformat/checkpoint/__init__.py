"""The checkpoint API: metadata documents, the commit protocol, save, open, validate, manage.

See docs/architecture.md (layer 4) for what each module does.
"""
