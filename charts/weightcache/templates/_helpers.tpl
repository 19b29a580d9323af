{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "weightcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; leaves room for the longest suffix the chart appends. */}}
{{- define "weightcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "weightcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightcache.labels" -}}
helm.sh/chart: {{ include "weightcache.chart" . }}
app.kubernetes.io/part-of: weightcache
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Operator pods. Agent pods are labelled by the operator (docs/interfaces.md). */}}
{{- define "weightcache.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightcache.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "weightcache.operator.labels" -}}
{{ include "weightcache.labels" . }}
{{ include "weightcache.operator.selectorLabels" . }}
{{- end }}

{{- define "weightcache.operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.operator.create }}
{{- default (printf "%s-operator" (include "weightcache.fullname" .)) .Values.serviceAccount.operator.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.operator.name }}
{{- end }}
{{- end }}

{{/* repository[:tag][@digest] with the optional registry prefix; tag defaults to appVersion. */}}
{{- define "weightcache.image" -}}
{{- $root := index . 0 }}
{{- $img := index . 1 }}
{{- $repo := $img.repository }}
{{- if $root.Values.imageRegistry }}
{{- $repo = printf "%s/%s" (trimSuffix "/" $root.Values.imageRegistry) $img.repository }}
{{- end }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default $root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{- define "weightcache.peeringName" -}}
{{- default (include "weightcache.fullname" .) .Values.operator.leaderElection.peeringName }}
{{- end }}

{{- define "weightcache.webhook.serviceName" -}}
{{- printf "%s-webhook" (include "weightcache.fullname" .) }}
{{- end }}

{{- define "weightcache.webhook.secretName" -}}
{{- printf "%s-webhook-tls" (include "weightcache.fullname" .) }}
{{- end }}

{{- define "weightcache.webhook.certName" -}}
{{- printf "%s-webhook" (include "weightcache.fullname" .) }}
{{- end }}

{{- define "weightcache.mutatingWebhookName" -}}
{{- printf "%s-mutating" (include "weightcache.fullname" .) }}
{{- end }}

{{- define "weightcache.validatingWebhookName" -}}
{{- printf "%s-validating" (include "weightcache.fullname" .) }}
{{- end }}

{{/* Namespaces whose agent pods get the NetworkPolicy. */}}
{{/*
Namespaces whose agent pods get the NetworkPolicy: agent.networkPolicy.namespaces when set;
otherwise where caches live: operator.watchNamespaces, the namespaces of .Values.caches and the
release namespace. NetworkPolicies are namespaced (no cluster-wide core policy), so when the
operator watches all namespaces, list the cache namespaces in agent.networkPolicy.namespaces;
NOTES.txt says so.
*/}}
{{- define "weightcache.agentNamespaces" -}}
{{- if .Values.agent.networkPolicy.namespaces }}
{{- toJson (.Values.agent.networkPolicy.namespaces | uniq) }}
{{- else }}
{{- $found := list }}
{{- range .Values.operator.watchNamespaces }}
{{- $found = append $found . }}
{{- end }}
{{- range .Values.caches }}
{{- $found = append $found (.namespace | default $.Release.Namespace) }}
{{- end }}
{{- if not .Values.operator.watchNamespaces }}
{{- $found = append $found .Release.Namespace }}
{{- end }}
{{- toJson ($found | uniq) }}
{{- end }}
{{- end }}

{{- define "weightcache.agentPriorityClassName" -}}
{{- if .Values.agent.priorityClass.name }}
{{- .Values.agent.priorityClass.name }}
{{- else if .Values.agent.priorityClass.create }}
{{- include "weightcache.fullname" . }}-agent
{{- end }}
{{- end }}

{{- define "weightcache.monitoringAvailable" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{- end }}
{{- end }}
