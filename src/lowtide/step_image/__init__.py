"""What a step's container image needs from lowtide in cluster mode (docs/cluster.md): the step
shim (`lowtide-step-shim`). Imports nothing of lowtide: it runs inside users' images.
"""
