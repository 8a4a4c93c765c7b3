{{- define "idemcoord.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "idemcoord.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "idemcoord.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "idemcoord.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "idemcoord.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idemcoord.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "idemcoord.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "idemcoord.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "idemcoord.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "idemcoord.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Where the config file comes from: "existingSecret" (auth.existingSecret),
"secret" (auth.tenants, rendered into <fullname>-config), or "configmap"
(auth off, --insecure-allow-no-auth). Auth is on by default: without tenants
and without insecureAllowNoAuth the chart refuses to render, as the binary
would refuse to start.
*/}}
{{- define "idemcoord.configSource" -}}
{{- if .Values.auth.existingSecret -}}
existingSecret
{{- else if .Values.auth.tenants -}}
secret
{{- else if .Values.auth.insecureAllowNoAuth -}}
configmap
{{- else -}}
{{- fail "auth is on by default: set auth.tenants (token hashes) or auth.existingSecret (a Secret holding the config file with tenants), or auth.insecureAllowNoAuth=true to serve every caller as tenant \"default\"" -}}
{{- end -}}
{{- end -}}

{{/* The config file rendered from config.file and auth.tenants. */}}
{{- define "idemcoord.configFile" -}}
{{- if hasKey .Values.config.file "tenants" -}}
{{- fail "config.file must not hold tenants: list them in auth.tenants (rendered into a Secret) or keep the whole file in auth.existingSecret" -}}
{{- end -}}
{{- $file := deepCopy .Values.config.file -}}
{{- if .Values.auth.tenants -}}
{{- $_ := set $file "tenants" .Values.auth.tenants -}}
{{- end -}}
{{- if not $file -}}
{{- fail "config.file is empty: the coordinator refuses an empty config file" -}}
{{- end -}}
{{ toYaml $file }}
{{- end -}}

{{/* The scheme of the HTTP listener: HTTPS when TLS is on. */}}
{{- define "idemcoord.httpScheme" -}}
{{- if .Values.tls.existingSecret -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}
