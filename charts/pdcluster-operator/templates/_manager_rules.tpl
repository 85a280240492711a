{{/* Generated from config/rbac/role.yaml by make manifests: do not edit. */}}
{{/* The manager's rules, granted cluster-wide or in each of .Values.watchNamespaces (manager-rbac.yaml). */}}
{{- define "pdcluster-operator.managerRules" -}}
rules:
- apiGroups:
  - ""
  resources:
  - configmaps
  - services
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - ""
  resources:
  - nodes
  verbs:
  - get
  - list
  - watch
- apiGroups:
  - ""
  resources:
  - pods
  verbs:
  - delete
  - get
  - list
  - patch
  - watch
- apiGroups:
  - apps
  resources:
  - deployments
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - events.k8s.io
  resources:
  - events
  verbs:
  - create
  - patch
- apiGroups:
  - leaderworkerset.x-k8s.io
  resources:
  - leaderworkersets
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - networking.k8s.io
  resources:
  - networkpolicies
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - policy
  resources:
  - poddisruptionbudgets
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - scheduling.k8s.io
  resources:
  - podgroups
  verbs:
  - create
  - delete
  - get
  - list
  - patch
  - update
  - watch
- apiGroups:
  - serving.pdcluster.dev
  resources:
  - pdclusters
  verbs:
  - get
  - list
  - watch
- apiGroups:
  - serving.pdcluster.dev
  resources:
  - pdclusters/status
  verbs:
  - get
  - patch
  - update
- apiGroups:
  - serving.pdcluster.dev
  resources:
  - poolscales
  verbs:
  - create
  - delete
  - get
  - list
  - watch
- apiGroups:
  - serving.pdcluster.dev
  resources:
  - poolscales/status
  verbs:
  - get
  - update
{{- end }}
