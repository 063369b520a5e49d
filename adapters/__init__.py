"""Adapters: one module per outside system (engines, discovery backends).

Adapters import the mechanisms' types (:mod:`quiesce.probe`, :mod:`quiesce.discovery`,
...) and never the lifecycle or the faces. Engine imports are lazy: importing an
adapter module never requires its engine.
"""
