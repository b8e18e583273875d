"""Ship: Kubernetes manifests for a served model, offline validation, checksums and a canary gate.

model.py reads what a deployment needs to know about a checkpoint (or a weightless description of one),
sizing.py turns that into GPUs, memory and a startup budget; manifests.py, autoscaling.py, rollout.py
and monitoring.py build plain dicts and generate.py writes them. validate.py checks a directory of
them (schemas/, kustomize.py for overlays, semantics.py and matching.py for cross-object checks).
checksums.py and versions.py back `deploy verify`, and canary.py is `gate canary`.
"""
