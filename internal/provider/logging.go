package provider

import "os"

// SilenceUnreadSDKLogs switches off the plugin SDK's trace loggers when
// Terraform would discard their output anyway: Terraform shows provider logs
// only when TF_LOG or TF_LOG_PROVIDER is set. Without this the SDK formats a
// dozen JSON trace lines per RPC for nobody, about a third of the provider's
// CPU in a large refresh. A level the user set explicitly is kept.
func SilenceUnreadSDKLogs() {
	if os.Getenv("TF_LOG") != "" || os.Getenv("TF_LOG_PROVIDER") != "" {
		return
	}
	for _, v := range []string{"TF_LOG_SDK", "TF_LOG_SDK_PROTO", "TF_LOG_SDK_FRAMEWORK"} {
		if os.Getenv(v) == "" {
			_ = os.Setenv(v, "OFF")
		}
	}
}
