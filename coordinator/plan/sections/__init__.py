"""The plan's sections by concern; :mod:`coordinator.plan.document` puts them together."""
