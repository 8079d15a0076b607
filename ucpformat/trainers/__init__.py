"""Trainer integrations: each trainer's own checkpoint switch saves and resumes UCP.

One module per trainer, imported on use (the trainer is an optional extra):
:mod:`ucpformat.trainers.lightning`, :mod:`ucpformat.trainers.transformers`,
:mod:`ucpformat.trainers.accelerate`, :mod:`ucpformat.trainers.torchtitan`; what they
share is :mod:`ucpformat.trainers.common`. What each stores where, and the tested versions,
are in docs/trainers.md.
"""
