{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "cachepilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "cachepilot.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cachepilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/). */}}
{{- define "cachepilot.labels" -}}
helm.sh/chart: {{ include "cachepilot.chart" . }}
{{ include "cachepilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cachepilot
{{- end }}

{{- define "cachepilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachepilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "cachepilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cachepilot.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cachepilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cachepilot.envoyImage" -}}
{{- if .Values.envoy.image.repository }}
{{- printf "%s:%s" .Values.envoy.image.repository (required "envoy.image.tag is required with envoy.image.repository" .Values.envoy.image.tag) }}
{{- else }}
{{- include "cachepilot.image" . }}
{{- end }}
{{- end }}

{{- define "cachepilot.adminSecretName" -}}
{{- default (printf "%s-admin" (include "cachepilot.fullname" .)) .Values.gateway.adminToken.existingSecret }}
{{- end }}

{{- define "cachepilot.leaseName" -}}
{{- default (printf "%s-leader" (include "cachepilot.fullname" .)) .Values.gateway.leaseName | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cachepilot.natsUrl" -}}
{{- .Values.replicaSync.natsUrl | default (printf "nats://%s-nats:4222" (include "cachepilot.fullname" .)) -}}
{{- end }}

{{- define "cachepilot.eppServiceName" -}}
{{- default (printf "%s-epp" (include "cachepilot.fullname" .)) .Values.epp.serviceName | trunc 63 | trimSuffix "-" }}
{{- end }}
