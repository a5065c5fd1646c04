{{- /* Labels shared by every object. Only the subset of Helm's template language in README.md is used. */ -}}
{{- define "lowtide.selectorLabels" -}}
app.kubernetes.io/name: lowtide
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{- define "lowtide.labels" -}}
{{ include "lowtide.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
helm.sh/chart: "{{ .Chart.Name }}-{{ .Chart.Version }}"
{{- end }}

{{- /* The ServiceAccount Workflow pods run as: stepServiceAccount.name, else RELEASE-step. */ -}}
{{- define "lowtide.stepServiceAccount" -}}
{{- if .Values.stepServiceAccount.name }}{{ .Values.stepServiceAccount.name }}{{- else }}{{ .Release.Name }}-step{{- end }}
{{- end }}
