"""Cluster mode's Argo Workflows pieces: the pure ones, tested in isolation, and the executor.

- `workflow`: a job spec compiled into one Argo `Workflow` object (a DAG of container templates,
  the step contract as env, the admission gate, the retry expression), with `ArgoSettings`.
- `expr`: a checker for the expr-lang subset our retry expressions use (what Argo evaluates),
  and an evaluator of it, for fakes of Argo's controller in tests.
- `node_status`: an Argo node (phase, message, exit code) mapped to a lowtide outcome, and a
  Retry node's children mapped to the list of attempts.
- `pods`, `k8s_errors`, `exits`: pure readings of pods and Argo names, API errors classified,
  and a node's outcome as the executor port's exit.

The one module here that talks to Kubernetes is `executor` (`ArgoExecutor`, the executor port
at runtime: submission, the admission patch, exits from Argo's nodes; docs/cluster.md "The Argo
executor at runtime"); `wiring` builds it for `executor.kind: argo`.
Neighbours: `cli.argo_cmd` (`lowtide argo render`) converts `config.ArgoConfig` into
`ArgoSettings` and prints what `workflow.compile_workflow` returns.
Must not (all but `executor`): talk to Kubernetes or Argo, read files or configuration, or read
the clock. See docs/cluster.md "Jobs as Argo Workflows".
"""
