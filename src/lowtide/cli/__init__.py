"""The `lowtide` command: talks to the REST API; `lowtide up` starts the embedded control plane."""
