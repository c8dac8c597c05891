// Command validate checks tally's deployment files without a Docker engine or a Kubernetes
// cluster (deploy/validate.sh runs it):
//
//   - a Compose file is loaded by compose-go, the library `docker compose` itself uses, which
//     validates it against the Compose specification's JSON schema and resolves it;
//   - a Kubernetes manifest is decoded document by document, strictly, into the API type its
//     kind names (unknown fields, misspelt fields and mistyped values fail).
//
// Usage: validate compose FILE... | validate k8s FILE...
package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: validate compose|k8s FILE...")
		os.Exit(2)
	}
	failed := false
	for _, path := range os.Args[2:] {
		var err error
		switch os.Args[1] {
		case "compose":
			err = compose(path)
		case "k8s":
			err = kubernetes(path)
		default:
			err = fmt.Errorf("unknown kind %q", os.Args[1])
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

func compose(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return err
	}
	details := types.ConfigDetails{
		WorkingDir:  filepath.Dir(abs),
		ConfigFiles: []types.ConfigFile{{Filename: abs}},
		Environment: types.Mapping{},
	}
	project, err := loader.LoadWithContext(context.Background(), details, func(o *loader.Options) {
		o.SetProjectName("tally", true)
	})
	if err != nil {
		return err
	}
	fmt.Printf("%s: valid Compose project %q with services %v\n", path, project.Name, project.ServiceNames())
	return nil
}

func kubernetes(path string) error {
	text, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	n := 0
	for _, doc := range bytes.Split(text, []byte("\n---\n")) {
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return err
		}
		var object any
		switch meta.APIVersion + "/" + meta.Kind {
		case "v1/ConfigMap":
			object = &corev1.ConfigMap{}
		case "v1/Secret":
			object = &corev1.Secret{}
		case "v1/Service":
			object = &corev1.Service{}
		case "apps/v1/Deployment":
			object = &appsv1.Deployment{}
		case "apps/v1/StatefulSet":
			object = &appsv1.StatefulSet{}
		case "policy/v1/PodDisruptionBudget":
			object = &policyv1.PodDisruptionBudget{}
		default:
			return fmt.Errorf("document %d: no decoder for %s %s", n+1, meta.APIVersion, meta.Kind)
		}
		if err := yaml.UnmarshalStrict(doc, object); err != nil {
			return fmt.Errorf("document %d (%s): %v", n+1, meta.Kind, err)
		}
		n++
		fmt.Printf("%s: document %d: valid %s %s\n", path, n, meta.APIVersion, meta.Kind)
	}
	if n == 0 {
		return fmt.Errorf("no documents")
	}
	return nil
}
