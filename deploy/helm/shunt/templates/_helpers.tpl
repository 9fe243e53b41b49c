{{- define "shunt.name" -}}shunt-agent{{- end -}}
{{- define "shunt.labels" -}}
app.kubernetes.io/name: shunt-agent
{{- end -}}
