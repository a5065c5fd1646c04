"""Deploying lowtide on Kubernetes: the Helm chart's objects rendered in Python.

`deploy.chart` loads `deploy/helm/lowtide/` and validates values; `deploy.manifests` builds the
objects. Sits beside `adapters` in the layers (it reads the chart's files). Must not: talk to a
cluster.
"""
